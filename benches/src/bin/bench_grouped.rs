//! Grouped bf16 GEMM for MoE: moefuse against dense cuBLAS on the same FLOPs, interleaved;
//! the PyTorch `torch._grouped_mm` baseline runs from `benches/torch_grouped_mm.py` on the
//! same cases (`bench_grouped --list-cases` hands it the shapes and per-expert rows).
//!
//! `bench_grouped --out DIR [--filter S] [--samples N]`. Each case is checked once before
//! timing (poisoned output; 32 sampled rows, or 4 experts × 8 rows for wgrad, against the f64
//! CPU reference). Appends to `DIR/grouped_gemm.jsonl`.

#![forbid(unsafe_code)]

use clap::Parser;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream};
use half::bf16;
use indicatif::ProgressBar;
use moefuse_benches::cases::{self, Case, Pass};
use moefuse_benches::{
    append, commit, open_gpu, rotation, time_interleaved, today, Backend, Error, Record,
};
use moefuse_grouped_gemm::{
    reference, BLayout, GemmDesc, GroupedDesc, GroupedGemm, GroupedOp, Raster, TileOrder,
};
use moefuse_testkit::{cublas_rowmajor, rel_err, Rng, POISON_BF16};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser)]
struct Args {
    /// Folder for the JSON lines.
    #[arg(long, default_value = "benches/results")]
    out: PathBuf,
    /// Print the cases as JSON and exit (for the PyTorch baseline).
    #[arg(long)]
    list_cases: bool,
    /// Only cases whose name contains this (a comma list: any of them).
    #[arg(long, default_value = "")]
    filter: String,
    /// Match `--filter` entries exactly instead of as substrings.
    #[arg(long)]
    exact: bool,
    /// Timed samples per backend.
    #[arg(long, default_value_t = 20)]
    samples: usize,
    /// Instead of the comparison: time every compiled variant of each case under each tile
    /// order (raster along M/N, swizzle 1/2/4), checked against the verified default
    /// output; appends to `DIR/grouped_gemm_sweep.jsonl`.
    #[arg(long)]
    sweep: bool,
}

/// Host copies of one case's operands and the problem they form.
struct Problem {
    desc: GroupedDesc,
    ends: Vec<i32>,
    a: Vec<bf16>,
    b: Vec<bf16>,
}

fn main() -> Result<(), Error> {
    let args = Args::parse();
    let wanted: Vec<&str> = args.filter.split(',').collect();
    let all: Vec<Case> = cases::all()
        .into_iter()
        .filter(|c| {
            wanted.iter().any(|w| {
                if args.exact {
                    c.name == *w
                } else {
                    c.name.contains(w)
                }
            })
        })
        .collect();
    if args.list_cases {
        println!("{}", serde_json::to_string(&all)?);
        return Ok(());
    }
    let Some(ctx) = open_gpu("bench_grouped") else {
        return Ok(());
    };
    let stream = ctx.default_stream();
    let gpu = ctx.name()?;
    let gemm = GroupedGemm::new(&ctx)?;
    let blas = CudaBlas::new(stream.clone())?;
    let bar = ProgressBar::new(all.len() as u64);
    let suite = if args.sweep {
        "grouped_gemm_sweep"
    } else {
        "grouped_gemm"
    };
    let mut records = Vec::new();
    for case in &all {
        bar.set_message(case.name.clone());
        let p = problem(case);
        let plan = gemm.plan(&p.desc)?;
        let [(_, a_len), (_, b_len), (_, d_len)] = p.desc.extents();
        let sets = rotation(&ctx, 2 * (a_len + b_len));
        let offsets = stream.clone_htod(&p.ends)?;
        let a: Vec<CudaSlice<bf16>> = (0..sets)
            .map(|_| stream.clone_htod(&p.a))
            .collect::<Result<_, _>>()?;
        let b: Vec<CudaSlice<bf16>> = (0..sets)
            .map(|_| stream.clone_htod(&p.b))
            .collect::<Result<_, _>>()?;
        let mut d = stream.clone_htod(&vec![POISON_BF16; d_len])?;
        let mut ws = stream.alloc_zeros::<u8>(plan.workspace_bytes().max(1))?;
        gemm.run(&plan, &stream, &offsets, &a[0], &b[0], &mut d, &mut ws)?;
        let err = sampled_err(&stream, &p, &d)?;
        if args.sweep {
            let verified = stream.clone_dtoh(&d)?;
            let inputs = (&offsets, &a[..], &b[..]);
            let rows = sweep(
                &gemm,
                &stream,
                case,
                &p,
                inputs,
                &verified,
                err,
                &gpu,
                args.samples,
            )?;
            append(&args.out, suite, &rows)?; // per case: a timeout keeps what is done
            bar.inc(1);
            continue;
        }

        // Dense cuBLAS with the same FLOPs: one [rows x n x k] product (wgrad: [k x n x rows]).
        let total: usize = case.sizes.iter().sum();
        let dense = match p.desc.op {
            GroupedOp::MGrouped(_) => {
                GemmDesc::new(total.max(8).next_multiple_of(8), p.desc.n, p.desc.k)
            }
            GroupedOp::KGrouped => {
                GemmDesc::new(p.desc.k, p.desc.n, total.max(8).next_multiple_of(8))
            }
        };
        let mut rng = Rng::new(7);
        let (da_h, db_h) = (
            rng.bf16_vec(dense.m * dense.k),
            rng.bf16_vec(dense.n * dense.k),
        );
        let (da, db) = (stream.clone_htod(&da_h)?, stream.clone_htod(&db_h)?);
        let mut dd = stream.alloc_zeros::<bf16>(dense.m * dense.n)?;
        cublas(&blas, &dense, &da, &db, &mut dd)?;
        let dense_err = dense_sampled_err(&stream, &dense, &da_h, &db_h, &dd)?;

        let mut backends: Vec<Backend> = vec![
            Box::new(|i| {
                Ok(gemm.run(
                    &plan,
                    &stream,
                    &offsets,
                    &a[i % sets],
                    &b[i % sets],
                    &mut d,
                    &mut ws,
                )?)
            }),
            Box::new(|_| cublas(&blas, &dense, &da, &db, &mut dd)),
        ];
        let stats = time_interleaved(&stream, &mut backends, 3, args.samples)?;
        drop(backends);
        for (backend, s, e, flops) in [
            ("moefuse", stats[0], err, case.flops()),
            ("cublas_dense", stats[1], dense_err, dense.flops()),
        ] {
            let tflops = flops / s.median_us / 1e6;
            println!("{:<48} {backend:<13} {:9.1} us [IQR {:6.1}] {tflops:6.1} TFLOP/s  rel err {e:.2e}  ({})", case.name, s.median_us, s.iqr_us, plan.variant());
            records.push(Record {
                suite: "grouped_gemm".into(),
                case: case.name.clone(),
                backend: backend.into(),
                gpu: gpu.clone(),
                gpus: None,
                median_us: s.median_us,
                iqr_us: s.iqr_us,
                tflops: Some(tflops),
                gbps: None,
                rel_err: e,
                date: today(),
                commit: commit(),
            });
        }
        append(&args.out, suite, &records)?;
        records.clear();
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(())
}

/// Every compiled variant of the case's op under each tile order, timed alone; each
/// output must match the verified default run (`rel_err` relative to it, then plus the
/// default's own error against the CPU reference).
#[allow(clippy::too_many_arguments)]
fn sweep(
    gemm: &GroupedGemm,
    stream: &Arc<CudaStream>,
    case: &Case,
    p: &Problem,
    (offsets, a, b): (&CudaSlice<i32>, &[CudaSlice<bf16>], &[CudaSlice<bf16>]),
    verified: &[bf16],
    verified_err: f64,
    gpu: &str,
    samples: usize,
) -> Result<Vec<Record>, Error> {
    let op = gemm.plan(&p.desc)?.variant();
    let op = op
        .split("_bf16")
        .next()
        .unwrap_or("")
        .split_once('_')
        .map_or("", |(_, o)| o)
        .to_string();
    let (major, minor) = stream.context().compute_capability()?;
    let arch = moefuse_kernels::arch_of(major, minor)?;
    let names: Vec<String> = moefuse_kernels::compiled()
        .iter()
        .filter(|v| v.spec.arch == arch)
        .map(|v| v.name())
        .filter(|n| n.contains(&format!("_{op}_")))
        .collect();
    let want: Vec<f32> = verified.iter().map(|x| x.to_f32()).collect();
    let sets = a.len();
    let mut out = Vec::new();
    for name in &names {
        // The contiguous kernel reads the swizzle field as its band height in m-block units,
        // can interleave its tile list's front and back (`i`) and has an L2 prefetch depth
        // (p<N>; measured slower, one depth kept); CUTLASS's take swizzle 1/2/4.
        let orders: Vec<(Raster, &str, u8, u8, bool)> = if name.ends_with("_contig") {
            vec![
                (Raster::AlongN, "N", 4, 0, false),
                (Raster::AlongN, "N", 4, 0, true),
                (Raster::AlongN, "N", 4, 4, false),
                (Raster::AlongM, "M", 4, 0, false),
                (Raster::AlongM, "M", 4, 0, true),
                (Raster::AlongN, "N", 16, 0, false),
            ]
        } else {
            [(Raster::AlongM, "M"), (Raster::AlongN, "N")]
                .iter()
                .flat_map(|&(r, n)| [1u8, 2, 4].map(|s| (r, n, s, 0u8, false)))
                .collect()
        };
        for &(raster, rname, swizzle, prefetch, interleave) in &orders {
            {
                let desc = GroupedDesc {
                    tile_order: TileOrder {
                        raster,
                        swizzle,
                        prefetch,
                        interleave,
                    },
                    ..p.desc
                };
                let plan = gemm.plan_with(&desc, Some(name))?;
                let mut d = stream.clone_htod(&vec![POISON_BF16; verified.len()])?;
                let mut ws = stream.alloc_zeros::<u8>(plan.workspace_bytes().max(1))?;
                gemm.run(&plan, stream, offsets, &a[0], &b[0], &mut d, &mut ws)?;
                let got: Vec<f32> = stream.clone_dtoh(&d)?.iter().map(|x| x.to_f32()).collect();
                let diff = rel_err(&got, &want);
                let mut one: Vec<Backend> = vec![Box::new(|i| {
                    Ok(gemm.run(
                        &plan,
                        stream,
                        offsets,
                        &a[i % sets],
                        &b[i % sets],
                        &mut d,
                        &mut ws,
                    )?)
                })];
                let s = time_interleaved(stream, &mut one, 2, samples)?[0];
                let tflops = case.flops() / s.median_us / 1e6;
                let mut label = format!("{}/{name}/r{rname}s{swizzle}", case.name);
                if prefetch != 0 {
                    label += &format!("p{prefetch}");
                }
                if interleave {
                    label += "i";
                }
                println!(
                    "{label:<100} {:9.1} us {tflops:6.1} TFLOP/s  diff {diff:.1e}",
                    s.median_us
                );
                out.push(Record {
                    suite: "grouped_gemm_sweep".into(),
                    case: label,
                    backend: "moefuse".into(),
                    gpu: gpu.into(),
                    gpus: None,
                    median_us: s.median_us,
                    iqr_us: s.iqr_us,
                    tflops: Some(tflops),
                    gbps: None,
                    rel_err: diff + verified_err,
                    date: today(),
                    commit: commit(),
                });
            }
        }
    }
    Ok(out)
}

/// The case as a moefuse problem, weights `[E, N, K]` as `nn.Linear` stores them.
fn problem(case: &Case) -> Problem {
    let (g, rows, n, k) = (
        case.sizes.len(),
        case.sizes.iter().sum::<usize>(),
        case.n,
        case.k,
    );
    let ends: Vec<i32> = case
        .sizes
        .iter()
        .scan(0i32, |acc, &s| {
            *acc += s as i32;
            Some(*acc)
        })
        .collect();
    let mut rng = Rng::new(Rng::fresh_seed());
    // dgrad reads dY [rows, N]; wgrad dW_e [N, K] = dY_eᵀ · X_e: A = dY [rows, N], B = X [rows, K].
    let (pass, a_len, b_len) = match case.pass {
        Pass::Fwd => (0, rows * k, g * n * k),
        Pass::Dgrad => (1, rows * n, g * n * k),
        Pass::Wgrad => (2, rows * n, rows * k),
    };
    let desc = moefuse_bench_capi::grouped_desc(pass, g, rows, n, k)
        .expect("every bench pass maps to a grouped problem");
    Problem {
        desc,
        ends,
        a: rng.bf16_vec(a_len),
        b: rng.bf16_vec(b_len),
    }
}

/// Relative error on sampled outputs against the f64 reference: 32 routed rows
/// (M-grouped) or 8 rows of 4 non-empty experts (K-grouped).
fn sampled_err(stream: &Arc<CudaStream>, p: &Problem, d: &CudaSlice<bf16>) -> Result<f64, Error> {
    let got = stream.clone_dtoh(d)?;
    let (n, k) = (p.desc.n, p.desc.k);
    let ranges = reference::group_ranges(&p.ends, p.desc.rows);
    let mut rng = Rng::new(11);
    let (mut g, mut w) = (Vec::new(), Vec::new());
    match p.desc.op {
        GroupedOp::MGrouped(layout) => {
            let total = ranges.last().map_or(0, |r| r.end);
            let mut rows: Vec<usize> = (0..32.min(total)).map(|_| rng.below(total)).collect();
            rows.sort_unstable();
            for (e, r) in ranges.iter().enumerate() {
                let mine: Vec<usize> = rows.iter().copied().filter(|x| r.contains(x)).collect();
                if mine.is_empty() {
                    continue;
                }
                let sub = GemmDesc {
                    m: p.desc.rows,
                    n,
                    k,
                    b_layout: layout,
                    alpha: 1.0,
                    beta: 0.0,
                };
                w.extend(reference::gemm(
                    &sub,
                    &p.a,
                    &p.b[e * n * k..(e + 1) * n * k],
                    None,
                    &mine,
                ));
                g.extend(
                    mine.iter()
                        .flat_map(|&x| got[x * n..(x + 1) * n].iter().map(|v| v.to_f32())),
                );
            }
        }
        GroupedOp::KGrouped => {
            let live: Vec<usize> = (0..ranges.len())
                .filter(|&e| !ranges[e].is_empty())
                .collect();
            for _ in 0..4.min(live.len()) {
                let e = live[rng.below(live.len())];
                let r = ranges[e].clone();
                let ps: Vec<usize> = (0..8).map(|_| rng.below(k)).collect();
                // Rows ps of D_e = A_eᵀ B_e: gather A_e's columns ps as an [8, m_e] operand.
                let m_e = r.len();
                let mut at = vec![bf16::ZERO; ps.len() * m_e];
                for (i, &pp) in ps.iter().enumerate() {
                    for (j, row) in r.clone().enumerate() {
                        at[i * m_e + j] = p.a[row * k + pp];
                    }
                }
                let sub = GemmDesc {
                    m: ps.len(),
                    n,
                    k: m_e,
                    b_layout: BLayout::Kn,
                    alpha: 1.0,
                    beta: 0.0,
                };
                w.extend(reference::gemm(
                    &sub,
                    &at,
                    &p.b[r.start * n..r.end * n],
                    None,
                    &(0..ps.len()).collect::<Vec<_>>(),
                ));
                g.extend(ps.iter().flat_map(|&pp| {
                    got[e * k * n + pp * n..e * k * n + (pp + 1) * n]
                        .iter()
                        .map(|v| v.to_f32())
                }));
            }
        }
    }
    Ok(rel_err(&g, &w))
}

fn dense_sampled_err(
    stream: &Arc<CudaStream>,
    desc: &GemmDesc,
    a: &[bf16],
    b: &[bf16],
    d: &CudaSlice<bf16>,
) -> Result<f64, Error> {
    let got = stream.clone_dtoh(d)?;
    let mut rng = Rng::new(13);
    let rows: Vec<usize> = (0..16).map(|_| rng.below(desc.m)).collect();
    let g: Vec<f32> = rows
        .iter()
        .flat_map(|&r| got[r * desc.n..(r + 1) * desc.n].iter().map(|v| v.to_f32()))
        .collect();
    Ok(rel_err(&g, &reference::gemm(desc, a, b, None, &rows)))
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
        true,
        a,
        b,
        d,
    )?)
}
