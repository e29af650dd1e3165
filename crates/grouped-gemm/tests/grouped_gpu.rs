//! GPU tests of the grouped GEMMs (forward/dgrad M-grouped in both weight layouts, wgrad
//! K-grouped with and without accumulation) against the CPU reference, for every compiled
//! variant of the device's arch: ragged, zero-row, single-expert and odd-sized groups, a
//! row capacity larger than the routed rows. Outputs are poisoned first; every element of
//! every group is compared, and rows or experts outside the groups must keep their bytes.

#![forbid(unsafe_code)]

mod common;

use cudarc::driver::{CudaContext, CudaStream};
use half::bf16;
use moefuse_grouped_gemm::{
    check_offsets, reference, BLayout, GemmError, GroupedDesc, GroupedGemm, Operand, TileOrder,
};
use moefuse_testkit::{check_close, GpuSuite, Rng, BF16_REL_ERR, POISON_BF16};
use std::sync::Arc;

/// (name, group sizes, spare rows past the last group, n, k)
fn layouts(rng: &mut Rng) -> Vec<(&'static str, Vec<usize>, usize, usize, usize)> {
    let ragged: Vec<usize> = (0..12).map(|_| rng.below(300)).collect();
    let mut with_zeros: Vec<usize> = (0..16).map(|_| 1 + rng.below(200)).collect();
    for e in [0, 5, 6, 15] {
        with_zeros[e] = 0;
    }
    let mut single = vec![0; 8];
    single[3] = 1000;
    vec![
        ("ragged", ragged, 37, 264, 520),
        ("zero_rows", with_zeros, 0, 512, 256),
        ("single_expert", single, 5, 136, 1032),
        ("odd_tiny", vec![1, 3, 0, 7, 129], 11, 8, 64),
        ("balanced", vec![512; 8], 0, 1536, 2048),
    ]
    .into_iter()
    // Under compute-sanitizer (run.sh sanitize sets MOEFUSE_UNDER_SANITIZER) the
    // 13-GFLOP balanced case alone outlasts racecheck's budget (> 500 s for one test); the
    // other layouts cover the same code paths at a fraction of the work.
    .filter(|l| l.0 != "balanced" || std::env::var_os("MOEFUSE_UNDER_SANITIZER").is_none())
    .collect()
}

fn ends_of(sizes: &[usize]) -> Vec<i32> {
    sizes
        .iter()
        .scan(0i32, |acc, &s| {
            *acc += s as i32;
            Some(*acc)
        })
        .collect()
}

/// Runs `desc` with `variant` and compares the whole output with the reference.
fn check(
    gemm: &GroupedGemm,
    stream: &Arc<CudaStream>,
    desc: &GroupedDesc,
    ends: &[i32],
    variant: Option<&str>,
    seed: u64,
    validate_offsets: bool,
) -> Result<f64, String> {
    let what = format!(
        "{:?} groups={} rows={} n={} k={} variant={variant:?} seed={seed}",
        desc.op, desc.groups, desc.rows, desc.n, desc.k
    );
    let mut rng = Rng::new(seed);
    let [(_, a_len), (_, b_len), (_, d_len)] = desc.extents();
    let a = rng.bf16_vec(a_len);
    let b = rng.bf16_vec(b_len);
    let d0 = if desc.beta != 0.0 {
        rng.bf16_vec(d_len)
    } else {
        vec![POISON_BF16; d_len]
    };
    let plan = gemm
        .plan_with(desc, variant)
        .map_err(|e| format!("{what}: {e}"))?;
    let e = |x: cudarc::driver::DriverError| format!("{what}: {x}");
    let offsets = stream.clone_htod(ends).map_err(e)?;
    if validate_offsets {
        check_offsets(stream, &offsets, desc.groups, desc.rows)
            .map_err(|x| format!("{what}: {x}"))?;
    }
    let (a_d, b_d, mut d_d) = (
        stream.clone_htod(&a).map_err(e)?,
        stream.clone_htod(&b).map_err(e)?,
        stream.clone_htod(&d0).map_err(e)?,
    );
    let mut ws = stream
        .alloc_zeros::<u8>(plan.workspace_bytes().max(1))
        .map_err(e)?;
    gemm.run(&plan, stream, &offsets, &a_d, &b_d, &mut d_d, &mut ws)
        .map_err(|x| format!("{what}: {x}"))?;
    let got_bits = stream.clone_dtoh(&d_d).map_err(e)?;
    let want = reference::grouped(desc, ends, &a, &b, &d0);
    // Elements the call must not touch keep their exact bits (poison included).
    let touched = common::touched_mask(desc, ends);
    for (i, (&g, &w0)) in got_bits.iter().zip(&d0).enumerate() {
        if !touched[i] && g.to_bits() != w0.to_bits() {
            return Err(format!(
                "{what} ({}): element {i} outside every group was overwritten",
                plan.variant()
            ));
        }
    }
    let (got, want): (Vec<f32>, Vec<f32>) = got_bits
        .iter()
        .zip(&want)
        .zip(&touched)
        .filter(|(_, &t)| t)
        .map(|((g, w), _)| (g.to_f32(), *w))
        .unzip();
    check_close(
        &got,
        &want,
        BF16_REL_ERR,
        &format!("{what} ({})", plan.variant()),
    )
}

fn every_variant(
    ctx: &Arc<CudaContext>,
    op_name: &str,
    make: impl Fn(usize, usize, usize, usize) -> GroupedDesc,
) -> Result<(), String> {
    let stream = ctx.default_stream();
    let gemm = GroupedGemm::new(ctx).map_err(|e| e.to_string())?;
    let variants = common::variants_for(ctx, op_name);
    if variants.is_empty() {
        return Err(format!("no compiled {op_name} variant for this GPU"));
    }
    let seed = Rng::fresh_seed();
    let mut rng = Rng::new(seed);
    for (name, sizes, spare, n, k) in layouts(&mut rng) {
        let rows = sizes.iter().sum::<usize>() + spare;
        let desc = make(sizes.len(), rows, n, k);
        let ends = ends_of(&sizes);
        for v in variants.iter().map(|v| Some(v.as_str())).chain([None]) {
            let err = check(&gemm, &stream, &desc, &ends, v, rng.next_u64(), true)?;
            println!("{op_name} {name} {v:?}: rel err {err:.2e}");
            // The contiguous kernel's other tile walk (front and back interleaved).
            if v.is_some_and(|v| v.ends_with("_contig")) {
                let mixed = GroupedDesc {
                    tile_order: TileOrder {
                        interleave: true,
                        ..desc.tile_order
                    },
                    ..desc
                };
                let err = check(&gemm, &stream, &mixed, &ends, v, rng.next_u64(), true)?;
                println!("{op_name} {name} {v:?} interleaved: rel err {err:.2e}");
            }
        }
    }
    Ok(())
}

fn main() {
    GpuSuite::new()
        .test("grouped_fwd_bnk_every_variant", |ctx| {
            every_variant(ctx, "grouped_fwd_bnk", |g, r, n, k| {
                GroupedDesc::forward(g, r, n, k, BLayout::Nk)
            })
        })
        .test("grouped_fwd_bkn_every_variant", |ctx| {
            every_variant(ctx, "grouped_fwd_bkn", |g, r, n, k| {
                GroupedDesc::forward(g, r, n, k, BLayout::Kn)
            })
        })
        .test("grouped_dgrad_both_weight_layouts", |ctx| {
            // dgrad reads W_e transposed: weights stored [n, k] run the [k, n] kernels.
            every_variant(ctx, "grouped_fwd_bkn", |g, r, n, k| {
                GroupedDesc::dgrad(g, r, k, n, BLayout::Nk)
            })?;
            every_variant(ctx, "grouped_fwd_bnk", |g, r, n, k| {
                GroupedDesc::dgrad(g, r, k, n, BLayout::Kn)
            })
        })
        .test("grouped_wgrad_every_variant", |ctx| {
            every_variant(ctx, "grouped_wgrad", GroupedDesc::wgrad)
        })
        .test("grouped_wgrad_accumulates", |ctx| {
            every_variant(ctx, "grouped_wgrad", |g, r, n, k| GroupedDesc {
                beta: 1.0,
                ..GroupedDesc::wgrad(g, r, n, k)
            })
        })
        .test("grouped_forward_alpha_beta", |ctx| {
            every_variant(ctx, "grouped_fwd_bnk", |g, r, n, k| GroupedDesc {
                alpha: 0.5,
                beta: -1.0,
                ..GroupedDesc::forward(g, r, n, k, BLayout::Nk)
            })
        })
        .test("grouped_rejects_bad_input_before_launch", |ctx| {
            let stream = ctx.default_stream();
            let gemm = GroupedGemm::new(ctx).map_err(|e| e.to_string())?;
            let desc = GroupedDesc::forward(4, 64, 64, 64, BLayout::Nk);
            let plan = gemm.plan(&desc).map_err(|e| e.to_string())?;
            let off = stream
                .clone_htod(&[16i32, 32, 48])
                .map_err(|e| e.to_string())?;
            let x = stream
                .alloc_zeros::<bf16>(64 * 64)
                .map_err(|e| e.to_string())?;
            let w = stream
                .alloc_zeros::<bf16>(4 * 64 * 64)
                .map_err(|e| e.to_string())?;
            let mut y = stream
                .alloc_zeros::<bf16>(64 * 64)
                .map_err(|e| e.to_string())?;
            let mut ws = stream
                .alloc_zeros::<u8>(plan.workspace_bytes())
                .map_err(|e| e.to_string())?;
            match gemm.run(&plan, &stream, &off, &x, &w, &mut y, &mut ws) {
                Err(GemmError::BufferTooSmall {
                    operand: Operand::Offsets,
                    needed: 4,
                    got: 3,
                }) => {}
                other => {
                    return Err(format!(
                        "short offsets: expected BufferTooSmall, got {other:?}"
                    ))
                }
            }
            let bad = stream
                .clone_htod(&[16i32, 8, 48, 64])
                .map_err(|e| e.to_string())?;
            match check_offsets(&stream, &bad, 4, 64) {
                Err(GemmError::InvalidOffsets { group: 1, .. }) => {}
                other => {
                    return Err(format!(
                        "decreasing offsets: expected InvalidOffsets, got {other:?}"
                    ))
                }
            }
            let mut small_ws = stream
                .alloc_zeros::<u8>(plan.workspace_bytes() / 2)
                .map_err(|e| e.to_string())?;
            let off4 = stream
                .clone_htod(&[16i32, 32, 48, 64])
                .map_err(|e| e.to_string())?;
            match gemm.run(&plan, &stream, &off4, &x, &w, &mut y, &mut small_ws) {
                Err(GemmError::BufferTooSmall {
                    operand: Operand::Workspace,
                    ..
                }) => Ok(()),
                other => Err(format!(
                    "small workspace: expected BufferTooSmall, got {other:?}"
                )),
            }
        })
        .test("grouped_graph_replays_with_new_routing", graph_replay)
        .test("grouped_out_of_range_offsets_stay_in_bounds", |ctx| {
            // Ends beyond `rows` must be clamped by the kernels: the result equals the
            // reference's clamped reading, and nothing outside the groups changes.
            let stream = ctx.default_stream();
            let gemm = GroupedGemm::new(ctx).map_err(|e| e.to_string())?;
            let desc = GroupedDesc::forward(4, 200, 64, 64, BLayout::Nk);
            check(
                &gemm,
                &stream,
                &desc,
                &[150, 190, 400, 1000],
                None,
                Rng::fresh_seed(),
                false,
            )
            .map(|_| ())
        })
        .run()
}

/// Captures one grouped forward into a CUDA graph, then replays it after writing new
/// routings into the same offsets buffer: each replay must equal the reference for its
/// routing and the eager run bit for bit.
fn graph_replay(ctx: &Arc<CudaContext>) -> Result<(), String> {
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    let e = |x: cudarc::driver::DriverError| x.to_string();
    // A fresh handle on the device's primary context that never creates a stream of its
    // own stays out of cudarc's multi-stream mode, so cudarc records no per-buffer events
    // (which must not enter the captured graph); capture runs on the per-thread default
    // stream (the legacy stream cannot be captured). No tracking opt-out is needed.
    let ctx = &CudaContext::new(ctx.ordinal()).map_err(e)?;
    let stream = ctx.per_thread_stream();
    let gemm = GroupedGemm::new(ctx).map_err(|x| x.to_string())?;
    let (groups, rows, n, k) = (8, 2048, 256, 512);
    let desc = GroupedDesc::forward(groups, rows, n, k, BLayout::Nk);
    let plan = gemm.plan(&desc).map_err(|x| x.to_string())?;
    let seed = Rng::fresh_seed();
    let mut rng = Rng::new(seed);
    let (a, b) = (rng.bf16_vec(rows * k), rng.bf16_vec(groups * n * k));
    let (a_d, b_d) = (
        stream.clone_htod(&a).map_err(e)?,
        stream.clone_htod(&b).map_err(e)?,
    );
    let mut off = stream.alloc_zeros::<i32>(groups).map_err(e)?;
    let mut d = stream.alloc_zeros::<bf16>(rows * n).map_err(e)?;
    let mut ws = stream
        .alloc_zeros::<u8>(plan.workspace_bytes())
        .map_err(e)?;
    let poison = vec![POISON_BF16; rows * n];
    let routings: [Vec<usize>; 3] = [
        vec![256; 8],
        vec![0, 700, 1, 0, 300, 0, 999, 48],
        vec![0, 0, 0, 2048, 0, 0, 0, 0],
    ];

    // Eager run of the first routing, then capture the same call.
    stream
        .memcpy_htod(&ends_of(&routings[0]), &mut off)
        .map_err(e)?;
    gemm.run(&plan, &stream, &off, &a_d, &b_d, &mut d, &mut ws)
        .map_err(|x| x.to_string())?;
    stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .map_err(e)?;
    let captured = gemm.run(&plan, &stream, &off, &a_d, &b_d, &mut d, &mut ws);
    let graph = stream.end_capture(CUgraphInstantiate_flags(0)).map_err(e)?;
    captured.map_err(|x| format!("run under capture: {x}"))?;
    let graph = graph.ok_or("capture produced no graph")?;

    for sizes in &routings {
        let ends = ends_of(sizes);
        stream.memcpy_htod(&ends, &mut off).map_err(e)?;
        stream.memcpy_htod(&poison, &mut d).map_err(e)?;
        gemm.run(&plan, &stream, &off, &a_d, &b_d, &mut d, &mut ws)
            .map_err(|x| x.to_string())?;
        let eager = stream.clone_dtoh(&d).map_err(e)?;
        stream.memcpy_htod(&poison, &mut d).map_err(e)?;
        graph.launch().map_err(e)?;
        let replay = stream.clone_dtoh(&d).map_err(e)?;
        let what = format!("graph replay, sizes {sizes:?}, seed {seed}");
        if let Some(i) = eager
            .iter()
            .zip(&replay)
            .position(|(x, y)| x.to_bits() != y.to_bits())
        {
            return Err(format!(
                "{what}: replay differs from the eager run at element {i}"
            ));
        }
        let want = reference::grouped(&desc, &ends, &a, &b, &poison);
        let live = ends.last().copied().unwrap_or(0) as usize * n;
        let got: Vec<f32> = replay[..live].iter().map(|x| x.to_f32()).collect();
        check_close(&got, &want[..live], BF16_REL_ERR, &what)?;
        if replay[live..]
            .iter()
            .any(|x| x.to_bits() != POISON_BF16.to_bits())
        {
            return Err(format!("{what}: rows past the last group were written"));
        }
    }
    Ok(())
}
