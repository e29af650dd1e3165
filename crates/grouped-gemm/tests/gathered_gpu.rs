//! GPU tests of the grouped GEMMs with a gathered operand (`GroupedGemm::run_gathered`): row
//! `r` of A (forward, dgrad, wgrad) or of B (wgrad) is row `index[r] / div` of a smaller
//! buffer, as the MoE layer's backward reads `x` and `dy` through `source_of`. Every
//! contiguous variant of the device's arch, ragged, zero-row, partial-chunk and odd-width
//! groups, beta 0 and 1, both tile walks; bad indices (negative, past the source) must read
//! zeros. The reference runs on the host-side gathered copy. Outputs poisoned first; rows
//! and experts outside the groups keep their bytes.

#![forbid(unsafe_code)]

mod common;

use cudarc::driver::{CudaContext, CudaStream};
use half::bf16;
use moefuse_grouped_gemm::{
    reference, BLayout, Gather, GatheredOperand, GemmError, GroupedDesc, GroupedGemm, Operand,
    TileOrder,
};
use moefuse_testkit::{check_close, GpuSuite, Rng, BF16_REL_ERR, POISON_BF16};
use std::sync::Arc;

/// One gathered problem: group sizes, spare rows, n, k, and the top-k the index divides by.
struct Case {
    name: &'static str,
    sizes: Vec<usize>,
    spare: usize,
    n: usize,
    k: usize,
    top_k: usize,
}

fn cases(rng: &mut Rng) -> Vec<Case> {
    let mut zeros: Vec<usize> = (0..16).map(|_| 1 + rng.below(200)).collect();
    for e in [0, 5, 6, 15] {
        zeros[e] = 0;
    }
    let ragged = (0..12).map(|_| rng.below(300)).collect();
    let c = |name, sizes, spare, n, k, top_k| Case {
        name,
        sizes,
        spare,
        n,
        k,
        top_k,
    };
    vec![
        c("ragged_top2", ragged, 37, 264, 520, 2),
        c("zero_rows_top4", zeros, 0, 512, 256, 4),
        c("odd_tiny_top1", vec![1, 3, 0, 7, 129], 11, 8, 64, 1),
        c("balanced_top8", vec![512; 8], 0, 1536, 2048, 8),
    ]
}

/// The slot index of each row (a random permutation of `0..tokens·top_k`, so `index /
/// top_k` names a token) with bad entries, which must read zeros: a negative one, one past
/// the source and `i32::MAX`.
fn routed_index(rng: &mut Rng, rows: usize, top_k: usize) -> (Vec<i32>, usize) {
    let tokens = rows.div_ceil(top_k).max(1);
    let mut slots: Vec<i32> = (0..(tokens * top_k) as i32).collect();
    for i in (1..slots.len()).rev() {
        slots.swap(i, rng.below(i + 1));
    }
    slots.truncate(rows);
    if rows > 3 {
        slots[rng.below(rows)] = -1 - rng.below(1000) as i32;
        slots[rng.below(rows)] = (tokens * top_k + rng.below(100)) as i32;
        slots[rng.below(rows)] = i32::MAX;
    }
    (slots, tokens)
}

fn check_one(
    gemm: &GroupedGemm,
    stream: &Arc<CudaStream>,
    case: &Case,
    desc: &GroupedDesc,
    operand: GatheredOperand,
    variant: &str,
    seed: u64,
) -> Result<f64, String> {
    let what = format!(
        "{} {:?} gathered {operand:?} beta={} interleave={} variant={variant} seed={seed}",
        case.name, desc.op, desc.beta, desc.tile_order.interleave
    );
    let mut rng = Rng::new(seed);
    let ends: Vec<i32> = case
        .sizes
        .iter()
        .scan(0i32, |acc, &s| {
            *acc += s as i32;
            Some(*acc)
        })
        .collect();
    let (index, tokens) = routed_index(&mut rng, desc.rows, case.top_k);
    let [(_, a_len), (_, b_len), (_, d_len)] = desc.extents();
    let width = match operand {
        GatheredOperand::A => desc.k,
        GatheredOperand::B => desc.n,
    };
    let source = rng.bf16_vec(tokens * width);
    // The permuted copy the kernel must behave as if it read.
    let mut gathered = vec![bf16::ZERO; desc.rows * width];
    for (r, &i) in index.iter().enumerate() {
        let t = (i >= 0).then(|| i as usize / case.top_k);
        if let Some(t) = t.filter(|&t| t < tokens) {
            gathered[r * width..(r + 1) * width]
                .copy_from_slice(&source[t * width..(t + 1) * width]);
        }
    }
    let (a, b) = match operand {
        GatheredOperand::A => (gathered, rng.bf16_vec(b_len)),
        GatheredOperand::B => (rng.bf16_vec(a_len), gathered),
    };
    let d0 = if desc.beta != 0.0 {
        rng.bf16_vec(d_len)
    } else {
        vec![POISON_BF16; d_len]
    };
    let plan = gemm
        .plan_with(desc, Some(variant))
        .map_err(|e| format!("{what}: {e}"))?;
    let e = |x: cudarc::driver::DriverError| format!("{what}: {x}");
    let (off_d, idx_d, src_d) = (
        stream.clone_htod(&ends).map_err(e)?,
        stream.clone_htod(&index).map_err(e)?,
        stream.clone_htod(&source).map_err(e)?,
    );
    // The operand that is not gathered goes whole; the gathered one is the source.
    let (a_d, b_d) = match operand {
        GatheredOperand::A => (src_d.clone(), stream.clone_htod(&b).map_err(e)?),
        GatheredOperand::B => (stream.clone_htod(&a).map_err(e)?, src_d.clone()),
    };
    let mut d_d = stream.clone_htod(&d0).map_err(e)?;
    let mut ws = stream
        .alloc_zeros::<u8>(plan.workspace_bytes().max(1))
        .map_err(e)?;
    let gather = Gather {
        operand,
        div: case.top_k,
        source_rows: tokens,
    };
    gemm.run_gathered(
        &plan, stream, &off_d, &a_d, &b_d, &idx_d, gather, &mut d_d, &mut ws,
    )
    .map_err(|x| format!("{what}: {x}"))?;
    let got_bits = stream.clone_dtoh(&d_d).map_err(e)?;
    let want = reference::grouped(desc, &ends, &a, &b, &d0);
    let touched = common::touched_mask(desc, &ends);
    let (mut got, mut wanted) = (Vec::new(), Vec::new());
    for (i, (&g, &w0)) in got_bits.iter().zip(&d0).enumerate() {
        if touched[i] {
            got.push(g.to_f32());
            wanted.push(want[i]);
        } else if g.to_bits() != w0.to_bits() {
            return Err(format!(
                "{what}: element {i} outside every group was overwritten"
            ));
        }
    }
    check_close(&got, &wanted, BF16_REL_ERR, &what)
}

/// Every contiguous variant whose name contains `op_name`, on every case, both walks.
fn every_contiguous_variant(
    ctx: &Arc<CudaContext>,
    op_name: &str,
    operand: GatheredOperand,
    make: impl Fn(usize, usize, usize, usize) -> GroupedDesc,
) -> Result<(), String> {
    let stream = ctx.default_stream();
    let gemm = GroupedGemm::new(ctx).map_err(|e| e.to_string())?;
    let variants: Vec<String> = common::variants_for(ctx, op_name)
        .into_iter()
        .filter(|v| v.ends_with("_contig"))
        .collect();
    if variants.is_empty() {
        return Err(format!(
            "no compiled contiguous {op_name} variant for this GPU"
        ));
    }
    let mut rng = Rng::new(Rng::fresh_seed());
    for case in cases(&mut rng) {
        let rows = case.sizes.iter().sum::<usize>() + case.spare;
        let desc = make(case.sizes.len(), rows, case.n, case.k);
        for v in &variants {
            for interleave in [false, true] {
                let order = TileOrder {
                    interleave,
                    ..desc.tile_order
                };
                let d = GroupedDesc {
                    tile_order: order,
                    ..desc
                };
                let err = check_one(&gemm, &stream, &case, &d, operand, v, rng.next_u64())?;
                println!(
                    "{} {op_name} {operand:?} {v} interleave={interleave}: rel err {err:.2e}",
                    case.name
                );
            }
        }
    }
    Ok(())
}

fn refuses_bad_input(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let stream = ctx.default_stream();
    let gemm = GroupedGemm::new(ctx).map_err(|e| e.to_string())?;
    let e = |x: cudarc::driver::DriverError| x.to_string();
    let off = stream.clone_htod(&[32i32, 64]).map_err(e)?;
    let idx = stream.clone_htod(&vec![0i32; 64]).map_err(e)?;
    let a = stream.alloc_zeros::<bf16>(64 * 64).map_err(e)?;
    let x = stream.alloc_zeros::<bf16>(32 * 64).map_err(e)?;
    let w = stream.alloc_zeros::<bf16>(2 * 64 * 64).map_err(e)?;
    let mut d = stream.alloc_zeros::<bf16>(2 * 64 * 64).map_err(e)?;
    let mut ws = stream.alloc_zeros::<u8>(1 << 16).map_err(e)?;
    let b_of = |div, source_rows| Gather {
        operand: GatheredOperand::B,
        div,
        source_rows,
    };
    // An M-grouped plan cannot gather B (its B is the weights).
    let fwd = GroupedDesc::forward(2, 64, 64, 64, BLayout::Nk);
    for v in common::variants_for(ctx, "grouped_fwd_bnk") {
        let plan = gemm.plan_with(&fwd, Some(&v)).map_err(|e| e.to_string())?;
        match gemm.run_gathered(
            &plan,
            &stream,
            &off,
            &a,
            &w,
            &idx,
            b_of(2, 32),
            &mut d,
            &mut ws,
        ) {
            Err(GemmError::PlanMismatch(_)) => {}
            other => {
                return Err(format!(
                    "{v} with a gathered B: expected PlanMismatch, got {other:?}"
                ))
            }
        }
    }
    // Nor can a variant that is not contiguous (CUTLASS's ptr-array kernels) gather at all.
    let desc = GroupedDesc::wgrad(2, 64, 64, 64);
    for v in common::variants_for(ctx, "grouped_wgrad")
        .iter()
        .filter(|v| !v.ends_with("_contig"))
    {
        let plan = gemm.plan_with(&desc, Some(v)).map_err(|e| e.to_string())?;
        match gemm.run_gathered(
            &plan,
            &stream,
            &off,
            &a,
            &x,
            &idx,
            b_of(2, 32),
            &mut d,
            &mut ws,
        ) {
            Err(GemmError::PlanMismatch(_)) => {}
            other => return Err(format!("{v}: expected PlanMismatch, got {other:?}")),
        }
    }
    let Some(contig) = common::variants_for(ctx, "grouped_wgrad")
        .into_iter()
        .find(|v| v.ends_with("_contig"))
    else {
        return Err("no compiled contiguous wgrad variant for this GPU".into());
    };
    let plan = gemm
        .plan_with(&desc, Some(&contig))
        .map_err(|e| e.to_string())?;
    let short = stream.clone_htod(&vec![0i32; 63]).map_err(e)?;
    match gemm.run_gathered(
        &plan,
        &stream,
        &off,
        &a,
        &x,
        &short,
        b_of(2, 32),
        &mut d,
        &mut ws,
    ) {
        Err(GemmError::BufferTooSmall {
            operand: Operand::RowIndex,
            needed: 64,
            got: 63,
        }) => {}
        other => {
            return Err(format!(
                "short index: expected BufferTooSmall, got {other:?}"
            ))
        }
    }
    // source_rows larger than the gathered buffer holds.
    match gemm.run_gathered(
        &plan,
        &stream,
        &off,
        &a,
        &x,
        &idx,
        b_of(2, 33),
        &mut d,
        &mut ws,
    ) {
        Err(GemmError::BufferTooSmall {
            operand: Operand::B,
            ..
        }) => {}
        other => {
            return Err(format!(
                "short source: expected BufferTooSmall, got {other:?}"
            ))
        }
    }
    match gemm.run_gathered(
        &plan,
        &stream,
        &off,
        &a,
        &x,
        &idx,
        b_of(0, 32),
        &mut d,
        &mut ws,
    ) {
        Err(GemmError::InvalidShape { .. }) => Ok(()),
        other => Err(format!("div 0: expected InvalidShape, got {other:?}")),
    }
}

fn main() {
    use GatheredOperand::{A, B};
    GpuSuite::new()
        .test("gathered_wgrad_b", |ctx| {
            every_contiguous_variant(ctx, "grouped_wgrad", B, GroupedDesc::wgrad)
        })
        .test("gathered_wgrad_a", |ctx| {
            every_contiguous_variant(ctx, "grouped_wgrad", A, GroupedDesc::wgrad)
        })
        .test("gathered_wgrad_accumulates", |ctx| {
            every_contiguous_variant(ctx, "grouped_wgrad", B, |g, r, n, k| GroupedDesc {
                beta: 1.0,
                ..GroupedDesc::wgrad(g, r, n, k)
            })
        })
        .test("gathered_forward_a_both_layouts", |ctx| {
            every_contiguous_variant(ctx, "grouped_fwd_bnk", A, |g, r, n, k| {
                GroupedDesc::forward(g, r, n, k, BLayout::Nk)
            })?;
            every_contiguous_variant(ctx, "grouped_fwd_bkn", A, |g, r, n, k| {
                GroupedDesc::forward(g, r, n, k, BLayout::Kn)
            })
        })
        .test("gathered_dgrad_a", |ctx| {
            // The down dgrad: dy's rows gathered, W_e read transposed ([n, k] stored: bkn).
            every_contiguous_variant(ctx, "grouped_fwd_bkn", A, |g, r, n, k| {
                GroupedDesc::dgrad(g, r, k, n, BLayout::Nk)
            })
        })
        .test(
            "gathered_rejects_bad_input_before_launch",
            refuses_bad_input,
        )
        .run()
}
