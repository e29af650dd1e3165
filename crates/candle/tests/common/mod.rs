//! Helpers of the CPU tests: reproducible random tensors and blocks, relative errors.

#![allow(dead_code)]

use candle::{DType, Device, Tensor, Var};
use moefuse::MoeConfig;
use moefuse_candle::{FlatLayout, MoeBlock};
use moefuse_testkit::{rel_err, Rng};

/// A tensor of `shape` uniform in `[-scale, scale)`, f32, from `rng`.
pub fn uniform(rng: &mut Rng, shape: &[usize], scale: f32, dev: &Device) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.uniform() * scale).collect();
    Tensor::from_vec(v, shape.to_vec(), dev).expect("tensor")
}

/// A block of `cfg` with random router (scale 0.2) and experts (scale 0.1), experts in
/// `dtype`, router f32.
pub fn random_block(cfg: MoeConfig, seed: u64, dtype: DType, dev: &Device) -> MoeBlock {
    let mut rng = Rng::new(seed);
    let router = uniform(&mut rng, &[cfg.experts, cfg.hidden], 0.2, dev);
    let experts = uniform(&mut rng, &[FlatLayout::new(&cfg).len()], 0.1, dev)
        .to_dtype(dtype)
        .expect("dtype");
    MoeBlock::new(
        cfg,
        Var::from_tensor(&router).expect("var"),
        Var::from_tensor(&experts).expect("var"),
    )
    .expect("block")
}

/// ‖got − want‖ / ‖want‖ of two tensors of one shape, in f32.
pub fn rel(got: &Tensor, want: &Tensor) -> f64 {
    assert_eq!(got.dims(), want.dims(), "rel: shapes differ");
    let f = |t: &Tensor| {
        t.to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .expect("to host")
    };
    rel_err(&f(got), &f(want))
}

/// Asserts `rel(got, want) < bound`, naming `what` and the error.
pub fn assert_close(got: &Tensor, want: &Tensor, bound: f64, what: &str) {
    let e = rel(got, want);
    assert!(
        moefuse_testkit::within(e, bound),
        "{what}: rel err {e:.3e} >= {bound:e}"
    );
}
