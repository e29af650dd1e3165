//! GEMM demo: `cargo xtask demo` (or `cargo run --release -p moefuse-grouped-gemm --example
//! gemm_demo -- [M N K]`).
//!
//! On a GPU: plans and runs moefuse's bf16 GEMM (default 8192³), checks it against the f64
//! CPU reference on 256 sampled rows, then times moefuse and cuBLAS side by side (CUDA
//! events, 5 warm-ups, 30 samples, median [IQR]) and prints TFLOP/s. Without a GPU: says
//! why, and runs the CPU reference on a small problem instead. Exit code 0 in both cases.

#![forbid(unsafe_code)]

use cudarc::cublas::CudaBlas;
use half::bf16;
use moefuse_grouped_gemm::{reference, Gemm, GemmDesc};
use moefuse_testkit::{
    cublas_rowmajor, rel_err, time_stream, to_f32, within, Rng, BF16_REL_ERR, POISON_BF16,
};
use std::time::Instant;

type Error = Box<dyn std::error::Error>;

fn main() -> Result<(), Error> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .init();
    let dims: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (m, n, k) = match dims[..] {
        [m, n, k] => (m, n, k),
        _ => (8192, 8192, 8192),
    };
    match moefuse_testkit::gpu() {
        Ok(ctx) => gpu_demo(&ctx, GemmDesc::new(m, n, k)),
        Err(why) => {
            println!("SKIPPED GPU demo: {why}");
            cpu_demo()
        }
    }
}

fn cpu_demo() -> Result<(), Error> {
    let desc = GemmDesc::new(256, 256, 256);
    let mut rng = Rng::new(Rng::fresh_seed());
    let (a, b) = (rng.bf16_vec(desc.m * desc.k), rng.bf16_vec(desc.n * desc.k));
    let start = Instant::now();
    let d = reference::gemm_all(&desc, &a, &b, None);
    let secs = start.elapsed().as_secs_f64();
    println!(
        "CPU reference {}x{}x{}: {:.2} GFLOP/s (f64 accumulation, rayon), checksum {:.4}",
        desc.m,
        desc.n,
        desc.k,
        desc.flops() / secs / 1e9,
        d.iter().map(|&x| x as f64).sum::<f64>()
    );
    Ok(())
}

fn gpu_demo(
    ctx: &std::sync::Arc<cudarc::driver::CudaContext>,
    desc: GemmDesc,
) -> Result<(), Error> {
    let stream = ctx.default_stream();
    let gemm = Gemm::new(ctx)?;
    let plan = gemm.plan(&desc)?;
    println!(
        "moefuse gemm on {}: {}x{}x{} bf16 -> variant {}",
        ctx.name()?,
        desc.m,
        desc.n,
        desc.k,
        plan.variant()
    );

    let seed = Rng::fresh_seed();
    let mut rng = Rng::new(seed);
    let (a_h, b_h) = (rng.bf16_vec(desc.m * desc.k), rng.bf16_vec(desc.n * desc.k));
    let a = stream.clone_htod(&a_h)?;
    let b = stream.clone_htod(&b_h)?;
    let mut d = stream.clone_htod(&vec![POISON_BF16; desc.m * desc.n])?;
    gemm.run(&plan, &stream, &a, &b, &mut d, None)?;
    let got = to_f32(&stream.clone_dtoh(&d)?);

    // Check 256 sampled rows (all when fewer) against the f64 reference.
    let rows: Vec<usize> = if desc.m <= 256 {
        (0..desc.m).collect()
    } else {
        (0..256).map(|_| rng.below(desc.m)).collect()
    };
    let got_rows: Vec<f32> = rows
        .iter()
        .flat_map(|&r| got[r * desc.n..(r + 1) * desc.n].iter().copied())
        .collect();
    let want_rows = reference::gemm(&desc, &a_h, &b_h, None, &rows);
    let err = rel_err(&got_rows, &want_rows);
    println!(
        "rel err vs f64 CPU reference on {} rows: {err:.2e} (bound {BF16_REL_ERR:e}, seed {seed})",
        rows.len()
    );
    if !within(err, BF16_REL_ERR) {
        return Err(format!("moefuse gemm is wrong: rel err {err:.3e}").into());
    }

    let ours = time_stream(&stream, 5, 30, |_| -> Result<(), Error> {
        gemm.run(&plan, &stream, &a, &b, &mut d, None)?;
        Ok(())
    })?;
    let blas = CudaBlas::new(stream.clone())?;
    let mut d_blas = stream.alloc_zeros::<bf16>(desc.m * desc.n)?;
    let theirs = time_stream(&stream, 5, 30, |_| -> Result<(), Error> {
        cublas_rowmajor(&blas, (desc.m, desc.n, desc.k), true, &a, &b, &mut d_blas)?;
        Ok(())
    })?;
    let blas_out = to_f32(&stream.clone_dtoh(&d_blas)?);
    let blas_err = rel_err(&got, &blas_out);
    for (name, s) in [("moefuse", ours), ("cuBLAS", theirs)] {
        println!(
            "{name:>8}: {:8.1} us [IQR {:.1}]  {:6.1} TFLOP/s",
            s.median_us,
            s.iqr_us,
            desc.flops() / s.median_us / 1e6
        );
    }
    println!(
        "moefuse vs cuBLAS output: rel diff {blas_err:.2e}; speed ratio {:.3}",
        theirs.median_us / ours.median_us
    );
    Ok(())
}
