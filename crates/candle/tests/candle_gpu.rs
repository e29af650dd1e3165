//! GPU tests of the candle op (feature `cuda`; SKIPPED without a GPU): moefuse's layer on
//! candle's stream against the same block written with candle's ops, in bf16 — forward
//! `y` and the gradients of `x`, the router weight and the flat expert weight, relative
//! error < 2e-2 — for a small Qwen3-shaped block, two calls before one backward (the
//! backward recomputes its forward), an optimizer step, and Qwen3-30B-A3B at T = 8192
//! (which also prints both sides' fwd+bwd time).
//!
//! Run: `cargo test -p moefuse-candle --features cuda --test candle_gpu` with
//! `CUDA_COMPUTE_CAP=90` (candle-kernels' build) on a machine with the CUDA libraries.

#![forbid(unsafe_code)]

use candle::{DType, Device, Module, Tensor, Var};
use candle_nn::{Optimizer, SGD};
use moefuse::MoeConfig;
use moefuse_candle::{candle_ops, qwen3_moe_config, FlatLayout, MoeBlock};
use moefuse_testkit::{rel_err, within, GpuSuite, Rng};
use std::time::Instant;

const REL: f64 = 2e-2;

fn e(err: impl std::fmt::Display) -> String {
    err.to_string()
}

/// A tensor uniform in `[-scale, scale)` of `shape`, in `dtype`, on `dev`.
fn uniform(
    rng: &mut Rng,
    shape: &[usize],
    scale: f32,
    dtype: DType,
    dev: &Device,
) -> Result<Tensor, String> {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.uniform() * scale).collect();
    Tensor::from_vec(v, shape.to_vec(), dev)
        .and_then(|t| t.to_dtype(dtype))
        .map_err(e)
}

fn block(cfg: MoeConfig, seed: u64, dev: &Device) -> Result<MoeBlock, String> {
    let mut rng = Rng::new(seed);
    let router = uniform(&mut rng, &[cfg.experts, cfg.hidden], 0.2, DType::F32, dev)?;
    let experts = uniform(
        &mut rng,
        &[FlatLayout::new(&cfg).len()],
        0.05,
        DType::BF16,
        dev,
    )?;
    MoeBlock::new(
        cfg,
        Var::from_tensor(&router).map_err(e)?,
        Var::from_tensor(&experts).map_err(e)?,
    )
    .map_err(e)
}

fn close(got: &Tensor, want: &Tensor, what: &str) -> Result<f64, String> {
    let host = |t: &Tensor| {
        t.to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(e)
    };
    let err = rel_err(&host(got)?, &host(want)?);
    if within(err, REL) {
        Ok(err)
    } else {
        Err(format!("{what}: rel err {err:.3e} >= {REL:e}"))
    }
}

/// The candle-ops block on the same Vars.
fn reference(block: &MoeBlock, x: &Tensor) -> Result<Tensor, String> {
    let logits = block.router_logits(x).map_err(e)?;
    candle_ops::forward(block.config(), x, &logits, block.experts().as_tensor()).map_err(e)
}

/// `(y, [dx, d_router, d_experts])` of `sum(f(x) ⊙ target)`.
fn grads(
    block: &MoeBlock,
    x: &Var,
    target: &Tensor,
    f: impl Fn(&Tensor) -> Result<Tensor, String>,
) -> Result<(Tensor, Vec<Tensor>), String> {
    let y = f(x.as_tensor())?;
    let loss = (&y.to_dtype(DType::F32).map_err(e)? * target)
        .and_then(|l| l.sum_all())
        .map_err(e)?;
    let g = loss.backward().map_err(e)?;
    let get = |t: &Tensor, what: &str| g.get(t).cloned().ok_or(format!("no gradient for {what}"));
    Ok((
        y,
        vec![
            get(x.as_tensor(), "x")?,
            get(block.router().as_tensor(), "router")?,
            get(block.experts().as_tensor(), "experts")?,
        ],
    ))
}

/// Our op vs candle ops, forward and gradients, on one case; returns the errors.
fn compare(cfg: MoeConfig, tokens: usize, seed: u64, name: &str) -> Result<(), String> {
    let dev = Device::new_cuda(0).map_err(e)?;
    let block = block(cfg, seed, &dev)?;
    let mut rng = Rng::new(seed ^ 0xc0de);
    let x = Var::from_tensor(&uniform(
        &mut rng,
        &[tokens, cfg.hidden],
        1.0,
        DType::BF16,
        &dev,
    )?)
    .map_err(e)?;
    let target = uniform(&mut rng, &[tokens, cfg.hidden], 1.0, DType::F32, &dev)?;
    let t0 = Instant::now();
    let (y, ours) = grads(&block, &x, &target, |x| block.forward(x).map_err(e))?;
    dev.synchronize().map_err(e)?;
    let t1 = Instant::now();
    let (y_ref, theirs) = grads(&block, &x, &target, |x| reference(&block, x))?;
    dev.synchronize().map_err(e)?;
    let t2 = Instant::now();
    let mut report = vec![format!(
        "y {:.2e}",
        close(&y, &y_ref, &format!("{name}: y"))?
    )];
    for (what, (a, b)) in ["dx", "d_router", "d_experts"]
        .iter()
        .zip(ours.iter().zip(&theirs))
    {
        report.push(format!(
            "{what} {:.2e}",
            close(a, b, &format!("{name}: {what}"))?
        ));
    }
    println!(
        "{name}: rel err {}; fwd+bwd (first call, incl. layer build) moefuse {:.1} ms, candle ops {:.1} ms",
        report.join(", "),
        (t1 - t0).as_secs_f64() * 1e3,
        (t2 - t1).as_secs_f64() * 1e3
    );
    Ok(())
}

fn small_matches() -> Result<(), String> {
    let cfg = qwen3_moe_config(256, 128, 16, 4, true).map_err(e)?;
    compare(cfg, 200, 1, "qwen3-shaped D256 I128 E16 k4 T200")?;
    compare(
        qwen3_moe_config(128, 64, 8, 2, false).map_err(e)?,
        1,
        2,
        "one token, no renorm",
    )
}

/// Two forwards through one block before one backward: the first call's backward finds
/// the layer holding the second call's state and recomputes its own forward.
fn two_calls_before_one_backward() -> Result<(), String> {
    let dev = Device::new_cuda(0).map_err(e)?;
    let cfg = qwen3_moe_config(256, 128, 16, 4, true).map_err(e)?;
    let block = block(cfg, 3, &dev)?;
    let mut rng = Rng::new(4);
    let x = Var::from_tensor(&uniform(&mut rng, &[64, 256], 1.0, DType::BF16, &dev)?).map_err(e)?;
    let x2 = uniform(&mut rng, &[48, 256], 1.0, DType::BF16, &dev)?;
    let target = uniform(&mut rng, &[64, 256], 1.0, DType::F32, &dev)?;
    let both =
        |f: &dyn Fn(&Tensor) -> Result<Tensor, String>, x: &Tensor| -> Result<Tensor, String> {
            let y = f(x)?;
            let s2 = f(&x2)?
                .to_dtype(DType::F32)
                .and_then(|t| t.sqr()?.mean_all())
                .map_err(e)?;
            (y.to_dtype(DType::F32).map_err(e)? + s2.broadcast_as((64, 256)).map_err(e)?).map_err(e)
        };
    let ours_f = |x: &Tensor| block.forward(x).map_err(e);
    let ref_f = |x: &Tensor| reference(&block, x);
    let (_, ours) = grads(&block, &x, &target, |x| both(&ours_f, x))?;
    let (_, theirs) = grads(&block, &x, &target, |x| both(&ref_f, x))?;
    for (what, (a, b)) in ["dx", "d_router", "d_experts"]
        .iter()
        .zip(ours.iter().zip(&theirs))
    {
        close(a, b, &format!("two calls: {what}"))?;
    }
    Ok(())
}

/// An SGD step writes into the flat Var's storage and the next forward reads it.
fn optimizer_step_in_place() -> Result<(), String> {
    let dev = Device::new_cuda(0).map_err(e)?;
    let cfg = qwen3_moe_config(256, 128, 16, 4, true).map_err(e)?;
    let block = block(cfg, 5, &dev)?;
    let mut rng = Rng::new(6);
    let x = uniform(&mut rng, &[128, 256], 1.0, DType::BF16, &dev)?;
    let alias = block.experts().as_tensor().clone();
    let before = alias.to_dtype(DType::F32).map_err(e)?;
    let y0 = block.forward(&x).map_err(e)?;
    let loss = y0
        .to_dtype(DType::F32)
        .and_then(|y| y.sqr()?.mean_all())
        .map_err(e)?;
    let mut opt = SGD::new(block.vars(), 10.0).map_err(e)?;
    opt.backward_step(&loss).map_err(e)?;
    let moved = (alias.to_dtype(DType::F32).map_err(e)? - &before)
        .and_then(|d| d.abs()?.max_all()?.to_scalar::<f32>())
        .map_err(e)?;
    if moved == 0.0 {
        return Err("the step did not change the flat Var's storage".into());
    }
    let y1 = block.forward(&x).map_err(e)?;
    close(&y1, &reference(&block, &x)?, "forward after the step")?;
    Ok(())
}

/// The acceptance shape: Qwen3-30B-A3B, T = 8192.
fn qwen3_30b_t8192() -> Result<(), String> {
    let cfg = qwen3_moe_config(2048, 768, 128, 8, true).map_err(e)?;
    compare(cfg, 8192, 7, "Qwen3-30B-A3B T8192")
}

fn main() {
    GpuSuite::new()
        .test("candle_op_matches_candle_ops_small", |_| small_matches())
        .test("candle_op_two_calls_before_one_backward", |_| {
            two_calls_before_one_backward()
        })
        .test("candle_op_optimizer_step_in_place", |_| {
            optimizer_step_in_place()
        })
        .test("candle_op_qwen3_30b_t8192", |_| qwen3_30b_t8192())
        .run()
}
