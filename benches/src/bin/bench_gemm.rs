//! Dense bf16 GEMM: moefuse against cuBLAS on identical inputs, interleaved.
//!
//! `bench_gemm --out DIR [--all-variants] [--samples N]` (on the H200 through the device
//! pack: `.device-pack/run.sh bench`). Each case is verified once (poisoned output,
//! 128 sampled rows against the f64 CPU reference) before it is timed; inputs rotate
//! through enough sets to exceed 3× L2. Appends to `DIR/gemm.jsonl` (and, with
//! `--all-variants`, every compiled variant of the case to `DIR/gemm_variants.jsonl`).

#![forbid(unsafe_code)]

use clap::Parser;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use indicatif::ProgressBar;
use moefuse_benches::{
    append, commit, open_gpu, rotation, time_interleaved, today, Backend, Error, Record,
};
use moefuse_grouped_gemm::{reference, BLayout, Gemm, GemmDesc};
use moefuse_testkit::{cublas_rowmajor, rel_err, to_f32, Rng, POISON_BF16};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser)]
struct Args {
    /// Folder for the JSON lines.
    #[arg(long, default_value = "benches/results")]
    out: PathBuf,
    /// Also time every compiled variant of each case.
    #[arg(long)]
    all_variants: bool,
    /// Timed samples per backend.
    #[arg(long, default_value_t = 30)]
    samples: usize,
}

const CASES: &[(&str, usize, usize, usize, BLayout)] = &[
    ("dense-8192-bnk", 8192, 8192, 8192, BLayout::Nk),
    ("dense-8192-bkn", 8192, 8192, 8192, BLayout::Kn),
    ("dense-4096-bnk", 4096, 4096, 4096, BLayout::Nk),
    (
        "dense-m65536-n1536-k2048-bnk",
        65536,
        1536,
        2048,
        BLayout::Nk,
    ),
    ("dense-m65536-n2048-k768-bnk", 65536, 2048, 768, BLayout::Nk),
    ("dense-m64-n4096-k7168-bnk", 64, 4096, 7168, BLayout::Nk),
];

struct Inputs {
    a: Vec<CudaSlice<bf16>>,
    b: Vec<CudaSlice<bf16>>,
    a_host: Vec<bf16>,
    b_host: Vec<bf16>,
}

fn main() -> Result<(), Error> {
    let args = Args::parse();
    let Some(ctx) = open_gpu("bench_gemm") else {
        return Ok(());
    };
    let stream = ctx.default_stream();
    let gpu = ctx.name()?;
    let gemm = Gemm::new(&ctx)?;
    let blas = CudaBlas::new(stream.clone())?;
    let bar = ProgressBar::new(CASES.len() as u64);
    let (mut records, mut variant_records) = (Vec::new(), Vec::new());
    for &(case, m, n, k, layout) in CASES {
        bar.set_message(case);
        let desc = GemmDesc {
            b_layout: layout,
            ..GemmDesc::new(m, n, k)
        };
        let inputs = upload(&ctx, &stream, &desc)?;
        let plan = gemm.plan(&desc)?;
        let mut d_ours = stream.clone_htod(&vec![POISON_BF16; m * n])?;
        let mut d_blas = stream.clone_htod(&vec![POISON_BF16; m * n])?;
        let sets = inputs.a.len();
        gemm.run(
            &plan,
            &stream,
            &inputs.a[0],
            &inputs.b[0],
            &mut d_ours,
            None,
        )?;
        cublas(&blas, &desc, &inputs.a[0], &inputs.b[0], &mut d_blas)?;
        let err_ours = sampled_err(&stream, &desc, &inputs, &d_ours)?;
        let err_blas = sampled_err(&stream, &desc, &inputs, &d_blas)?;
        let mut backends: Vec<Backend> = vec![
            Box::new(|i| {
                Ok(gemm.run(
                    &plan,
                    &stream,
                    &inputs.a[i % sets],
                    &inputs.b[i % sets],
                    &mut d_ours,
                    None,
                )?)
            }),
            Box::new(|i| {
                cublas(
                    &blas,
                    &desc,
                    &inputs.a[i % sets],
                    &inputs.b[i % sets],
                    &mut d_blas,
                )
            }),
        ];
        let stats = time_interleaved(&stream, &mut backends, 5, args.samples)?;
        drop(backends);
        for (backend, s, err) in [
            ("moefuse", stats[0], err_ours),
            ("cublas", stats[1], err_blas),
        ] {
            let tflops = desc.flops() / s.median_us / 1e6;
            println!("{case:<32} {backend:<8} {:9.1} us [IQR {:6.1}] {tflops:6.1} TFLOP/s  rel err {err:.2e}  ({})", s.median_us, s.iqr_us, plan.variant());
            records.push(record("gemm", case, backend, &gpu, s, tflops, err));
        }
        if args.all_variants {
            variant_records.extend(time_variants(
                &gemm,
                &stream,
                &desc,
                case,
                &inputs,
                &gpu,
                args.samples,
            )?);
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    append(&args.out, "gemm", &records)?;
    if args.all_variants {
        append(&args.out, "gemm_variants", &variant_records)?;
    }
    Ok(())
}

fn record(
    suite: &str,
    case: &str,
    backend: &str,
    gpu: &str,
    s: moefuse_testkit::Stats,
    tflops: f64,
    err: f64,
) -> Record {
    Record {
        suite: suite.into(),
        case: case.into(),
        backend: backend.into(),
        gpu: gpu.into(),
        gpus: None,
        median_us: s.median_us,
        iqr_us: s.iqr_us,
        tflops: Some(tflops),
        gbps: None,
        rel_err: err,
        date: today(),
        commit: commit(),
    }
}

/// Every compiled variant for the case's arch and layout, verified then timed alone.
fn time_variants(
    gemm: &Gemm,
    stream: &Arc<CudaStream>,
    desc: &GemmDesc,
    case: &str,
    inputs: &Inputs,
    gpu: &str,
    samples: usize,
) -> Result<Vec<Record>, Error> {
    let (major, minor) = stream.context().compute_capability()?;
    let arch = moefuse_kernels::arch_of(major, minor)?;
    let op = if desc.b_layout == BLayout::Nk {
        "gemm_bnk"
    } else {
        "gemm_bkn"
    };
    let mut out = Vec::new();
    for v in moefuse_kernels::compiled()
        .iter()
        .filter(|v| v.spec.arch == arch)
        .map(|v| v.name())
        .filter(|n| n.contains(op))
    {
        let plan = gemm.plan_with(desc, Some(&v))?;
        let mut d = stream.clone_htod(&vec![POISON_BF16; desc.m * desc.n])?;
        gemm.run(&plan, stream, &inputs.a[0], &inputs.b[0], &mut d, None)?;
        let err = sampled_err(stream, desc, inputs, &d)?;
        let sets = inputs.a.len();
        let mut one: Vec<Backend> = vec![Box::new(|i| {
            Ok(gemm.run(
                &plan,
                stream,
                &inputs.a[i % sets],
                &inputs.b[i % sets],
                &mut d,
                None,
            )?)
        })];
        let s = time_interleaved(stream, &mut one, 3, samples)?[0];
        let tflops = desc.flops() / s.median_us / 1e6;
        println!(
            "  {v:<56} {:9.1} us {tflops:6.1} TFLOP/s  rel err {err:.2e}",
            s.median_us
        );
        out.push(record(
            "gemm_variants",
            &format!("{case}/{v}"),
            "moefuse",
            gpu,
            s,
            tflops,
            err,
        ));
    }
    Ok(out)
}

fn upload(
    ctx: &Arc<cudarc::driver::CudaContext>,
    stream: &Arc<CudaStream>,
    desc: &GemmDesc,
) -> Result<Inputs, Error> {
    let mut rng = Rng::new(Rng::fresh_seed());
    let a_host = rng.bf16_vec(desc.m * desc.k);
    let b_host = rng.bf16_vec(desc.n * desc.k);
    let sets = rotation(ctx, 2 * (a_host.len() + b_host.len()));
    let mut inputs = Inputs {
        a: Vec::new(),
        b: Vec::new(),
        a_host,
        b_host,
    };
    for _ in 0..sets {
        inputs.a.push(stream.clone_htod(&inputs.a_host)?);
        inputs.b.push(stream.clone_htod(&inputs.b_host)?);
    }
    Ok(inputs)
}

/// Relative error of 128 sampled rows (all rows when fewer) against the f64 reference.
fn sampled_err(
    stream: &Arc<CudaStream>,
    desc: &GemmDesc,
    inputs: &Inputs,
    d: &CudaSlice<bf16>,
) -> Result<f64, Error> {
    let got = to_f32(&stream.clone_dtoh(d)?);
    let mut rng = Rng::new(desc.m as u64 ^ 0x5eed);
    let rows: Vec<usize> = if desc.m <= 128 {
        (0..desc.m).collect()
    } else {
        (0..128).map(|_| rng.below(desc.m)).collect()
    };
    let g: Vec<f32> = rows
        .iter()
        .flat_map(|&r| got[r * desc.n..(r + 1) * desc.n].iter().copied())
        .collect();
    let w = reference::gemm(desc, &inputs.a_host, &inputs.b_host, None, &rows);
    Ok(rel_err(&g, &w))
}

fn cublas(
    blas: &CudaBlas,
    desc: &GemmDesc,
    a: &CudaSlice<bf16>,
    b: &CudaSlice<bf16>,
    d: &mut CudaSlice<bf16>,
) -> Result<(), Error> {
    Ok(cublas_rowmajor(
        blas,
        (desc.m, desc.n, desc.k),
        desc.b_layout == BLayout::Nk,
        a,
        b,
        d,
    )?)
}
