//! Training through the op with candle-nn's optimizers: a step writes into the flat Var's
//! own storage (a clone of its tensor taken before the step sees the new values), exactly
//! `w − lr·g` for SGD, the next forward reads the new weights (equal to the candle-ops
//! block on them, relative error < 1e-4), and AdamW steps lower a regression loss.

mod common;

use candle::{DType, Device, Module, Tensor};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, SGD};
use common::{assert_close, random_block, rel, uniform};
use moefuse_candle::{candle_ops, qwen3_moe_config};
use moefuse_testkit::Rng;

#[test]
fn sgd_step_updates_the_flat_var_in_place_and_the_next_forward_sees_it() {
    let dev = Device::Cpu;
    let cfg = qwen3_moe_config(64, 64, 8, 2, true).unwrap();
    let block = random_block(cfg, 7, DType::F32, &dev);
    let mut rng = Rng::new(8);
    let x = uniform(&mut rng, &[12, 64], 1.0, &dev);
    let target = uniform(&mut rng, &[12, 64], 0.5, &dev);

    let alias = block.experts().as_tensor().clone();
    let before = alias.to_vec1::<f32>().unwrap();
    let y0 = block.forward(&x).unwrap();
    let loss = (&y0 - &target).unwrap().sqr().unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let g = grads
        .get(block.experts().as_tensor())
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let lr = 0.05;
    let mut opt = SGD::new(block.vars(), lr).unwrap();
    opt.step(&grads).unwrap();

    let after = alias.to_vec1::<f32>().unwrap();
    assert!(after != before, "the step did not reach the alias");
    for (j, ((a, b), g)) in after.iter().zip(&before).zip(&g).enumerate() {
        let want = b - (lr as f32) * g;
        assert!(
            (a - want).abs() <= 1e-6 * want.abs().max(1.0),
            "w[{j}] = {a}, want {want}"
        );
    }
    let y1 = block.forward(&x).unwrap();
    assert!(
        rel(&y1, &y0) > 1e-4,
        "the next forward did not see the step"
    );
    let logits = block.router_logits(&x).unwrap();
    let want = candle_ops::forward(&cfg, &x, &logits, &alias).unwrap();
    assert_close(&y1, &want, 1e-4, "forward after the step");
}

#[test]
fn adamw_steps_lower_a_regression_loss() {
    let dev = Device::Cpu;
    let cfg = qwen3_moe_config(64, 64, 4, 2, true).unwrap();
    let block = random_block(cfg, 9, DType::F32, &dev);
    let teacher = random_block(cfg, 10, DType::F32, &dev);
    let x = uniform(&mut Rng::new(11), &[32, 64], 1.0, &dev);
    let target = teacher.forward(&x).unwrap().detach();
    let params = ParamsAdamW {
        lr: 3e-3,
        weight_decay: 0.0,
        ..Default::default()
    };
    let mut opt = AdamW::new(block.vars(), params).unwrap();
    let mse = |y: Tensor| (y - &target).unwrap().sqr().unwrap().mean_all().unwrap();
    let mut losses = Vec::new();
    for _ in 0..8 {
        let loss = mse(block.forward(&x).unwrap());
        losses.push(loss.to_scalar::<f32>().unwrap());
        opt.backward_step(&loss).unwrap();
    }
    let last = *losses.last().unwrap();
    assert!(last < 0.8 * losses[0], "loss did not fall: {losses:?}");
}
