//! The op on the CPU against the same block written with candle's own ops
//! (`moefuse_candle::candle_ops`): forward `y`, and the gradients of `x` (through the
//! experts and the router), of the router weight and of the flat expert weight, in f32 —
//! relative error < 1e-4 (both sides are f32; moefuse's reference sums in f64).

mod common;

use candle::{DType, Device, Module, Tensor, Var};
use common::{assert_close, random_block, uniform};
use moefuse::{GateUpLayout, MoeConfig, RouterKind};
use moefuse_candle::{candle_ops, mixtral_config, qwen3_moe_config, MoeBlock, MoeOp};
use moefuse_testkit::Rng;

const REL: f64 = 1e-4;

/// `sum(y ⊙ target)` through `f`, and the gradients of `x`, router and experts.
fn grads_of(
    block: &MoeBlock,
    x: &Var,
    target: &Tensor,
    f: impl Fn(&Tensor) -> Tensor,
) -> (Tensor, [Tensor; 3]) {
    let y = f(x.as_tensor());
    let loss = (&y * target).unwrap().sum_all().unwrap();
    let g = loss.backward().unwrap();
    let get = |t: &Tensor| g.get(t).expect("gradient").clone();
    let grads = [
        get(x.as_tensor()),
        get(block.router().as_tensor()),
        get(block.experts().as_tensor()),
    ];
    (y, grads)
}

/// Our block vs the candle-ops block on the same Vars, one case.
fn compare(name: &str, cfg: MoeConfig, tokens: usize, seed: u64) {
    let dev = Device::Cpu;
    let block = random_block(cfg, seed, DType::F32, &dev);
    let mut rng = Rng::new(seed ^ 0x5eed);
    let x = Var::from_tensor(&uniform(&mut rng, &[tokens, cfg.hidden], 1.0, &dev)).unwrap();
    let target = uniform(&mut rng, &[tokens, cfg.hidden], 1.0, &dev);
    let (y, ours) = grads_of(&block, &x, &target, |x| block.forward(x).unwrap());
    let (y_ref, theirs) = grads_of(&block, &x, &target, |x| {
        let logits = block.router_logits(x).unwrap();
        candle_ops::forward(&cfg, x, &logits, block.experts().as_tensor()).unwrap()
    });
    assert_close(&y, &y_ref, REL, &format!("{name}: y"));
    for (what, (a, b)) in ["dx", "d_router", "d_experts"]
        .iter()
        .zip(ours.iter().zip(&theirs))
    {
        assert_close(a, b, REL, &format!("{name}: {what}"));
    }
}

#[test]
fn forward_and_gradients_match_the_candle_ops_block() {
    let q = qwen3_moe_config(64, 64, 8, 2, true).unwrap();
    compare("qwen3-shaped E8 k2", q, 24, 1);
    compare(
        "qwen3 no renorm E8 k3",
        qwen3_moe_config(128, 64, 8, 3, false).unwrap(),
        17,
        2,
    );
    compare(
        "mixtral-shaped E4 k2",
        mixtral_config(64, 128, 4, 2).unwrap(),
        9,
        3,
    );
    let inter = q.with_gate_up_layout(GateUpLayout::Interleaved);
    compare("interleaved gate/up", inter, 13, 4);
    compare("top-1 of 2, one token", MoeConfig::new(64, 64, 2, 1), 1, 5);
}

/// Two forwards through one block before one backward: each call's gradient is its own.
#[test]
fn two_calls_before_one_backward() {
    let dev = Device::Cpu;
    let cfg = qwen3_moe_config(64, 64, 8, 2, true).unwrap();
    let block = random_block(cfg, 11, DType::F32, &dev);
    let mut rng = Rng::new(12);
    let x = Var::from_tensor(&uniform(&mut rng, &[10, 64], 1.0, &dev)).unwrap();
    let x2 = uniform(&mut rng, &[6, 64], 1.0, &dev);
    let t2 = uniform(&mut rng, &[6, 64], 1.0, &dev);
    let target = uniform(&mut rng, &[10, 64], 1.0, &dev);
    let extra = |y2: Tensor| (y2 * &t2).unwrap().sum_all().unwrap();
    let (_, ours) = grads_of(&block, &x, &target, |x| {
        let y = block.forward(x).unwrap();
        let l2 = extra(block.forward(&x2).unwrap());
        (y + l2.broadcast_as((10, 64)).unwrap() / 640.0).unwrap()
    });
    let reference = |x: &Tensor| {
        let logits = block.router_logits(x).unwrap();
        candle_ops::forward(&cfg, x, &logits, block.experts().as_tensor()).unwrap()
    };
    let (_, theirs) = grads_of(&block, &x, &target, |x| {
        let y = reference(x);
        let l2 = extra(reference(&x2));
        (y + l2.broadcast_as((10, 64)).unwrap() / 640.0).unwrap()
    });
    for (what, (a, b)) in ["dx", "d_router", "d_experts"]
        .iter()
        .zip(ours.iter().zip(&theirs))
    {
        assert_close(a, b, REL, &format!("two calls: {what}"));
    }
}

/// `x [B, S, D]` is flattened into tokens and `y` comes back in its shape; bf16 tensors
/// run on the CPU too (f32 inside), output in `x`'s dtype.
#[test]
fn batched_shapes_and_bf16_on_the_cpu() {
    let dev = Device::Cpu;
    let cfg = qwen3_moe_config(64, 64, 4, 2, true).unwrap();
    let block = random_block(cfg, 21, DType::F32, &dev);
    let mut rng = Rng::new(22);
    let x = uniform(&mut rng, &[2, 5, 64], 1.0, &dev);
    let y = block.forward(&x).unwrap();
    assert_eq!(y.dims(), &[2, 5, 64]);
    let flat = block.forward(&x.reshape((10, 64)).unwrap()).unwrap();
    assert_close(
        &y.reshape((10, 64)).unwrap(),
        &flat,
        1e-7,
        "batched vs flat",
    );

    let op = MoeOp::new(cfg).unwrap();
    let x2 = x.reshape((10, 64)).unwrap();
    let logits = block.router_logits(&x2).unwrap();
    let xb = x2.to_dtype(DType::BF16).unwrap();
    let wb = block.experts().as_tensor().to_dtype(DType::BF16).unwrap();
    let yb = op.apply(&xb, &logits, &wb).unwrap();
    assert_eq!(yb.dtype(), DType::BF16);
    assert_close(&yb, &flat, 2e-2, "bf16 inputs");
}

#[test]
fn wrong_shapes_devices_and_routers_are_typed_errors() {
    let dev = Device::Cpu;
    let cfg = MoeConfig::new(64, 64, 4, 2);
    let op = MoeOp::new(cfg).unwrap();
    let x = Tensor::zeros((3, 64), DType::F32, &dev).unwrap();
    let w = Tensor::zeros(op.layout().len(), DType::F32, &dev).unwrap();
    let bad_logits = Tensor::zeros((3, 5), DType::F32, &dev).unwrap();
    let err = op.apply(&x, &bad_logits, &w).unwrap_err().to_string();
    assert!(
        err.contains("logits [T, E]") && err.contains("[3, 4]"),
        "{err}"
    );
    let logits = Tensor::zeros((3, 4), DType::F32, &dev).unwrap();
    let short = Tensor::zeros(7, DType::F32, &dev).unwrap();
    let err = op.apply(&x, &logits, &short).unwrap_err().to_string();
    assert!(err.contains("experts"), "{err}");
    let ints = Tensor::zeros((3, 64), DType::U32, &dev).unwrap();
    let err = op.apply(&ints, &logits, &w).unwrap_err().to_string();
    assert!(err.contains("dtype"), "{err}");
    let external = cfg.with_router(RouterKind::External);
    assert!(MoeOp::new(external).is_err());
    let too_many = Tensor::zeros((65537, 64), DType::F32, &dev).unwrap();
    let l2 = Tensor::zeros((65537, 4), DType::F32, &dev).unwrap();
    let err = op.apply(&too_many, &l2, &w).unwrap_err().to_string();
    assert!(err.contains("65537"), "{err}");
    let block = random_block(cfg, 1, DType::F32, &dev);
    let err = block.forward(&Tensor::zeros((2, 32), DType::F32, &dev).unwrap());
    assert!(err.unwrap_err().to_string().contains("x [.., D]"));
}
