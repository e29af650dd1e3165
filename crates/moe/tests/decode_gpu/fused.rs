//! The fused decode kernel (one grid, a grid barrier between gate_up and down) against the
//! two-kernel path it replaces: the same bits for `y`, `h` and the expert-major copies a
//! training forward keeps, over activations, layouts, top-k and token counts; the barrier
//! words left as found apart from one generation per call, so calls in a row (and graph
//! replays) need no reset.

use super::e;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use half::bf16;
use moefuse::gpu::ActivationDesc;
use moefuse::{Activation, GateUpLayout};
use moefuse_kernels::{self as mk, Kernels};
use moefuse_testkit::{Rng, POISON_BF16};
use std::sync::Arc;

/// (D, I, E, k, T, activation, layout)
type Shape = (usize, usize, usize, usize, usize, Activation, GateUpLayout);

const SHAPES: &[Shape] = &[
    (
        2048,
        768,
        128,
        8,
        1,
        Activation::SwiGlu,
        GateUpLayout::Split,
    ),
    (
        2048,
        768,
        128,
        8,
        8,
        Activation::SwiGlu,
        GateUpLayout::Split,
    ),
    (
        160,
        96,
        16,
        16,
        64,
        Activation::GeGlu,
        GateUpLayout::Interleaved,
    ),
    (288, 224, 8, 1, 37, Activation::Relu2, GateUpLayout::Split),
    (
        96,
        64,
        4,
        2,
        64,
        Activation::BoundedSwiGlu { limit: 3.0 },
        GateUpLayout::Interleaved,
    ),
];

struct Outputs {
    y: Vec<u16>,
    h: Vec<u16>,
    h_pre_rows: Vec<u16>,
    y_e_rows: Vec<u16>,
}

fn poisoned(s: &Arc<CudaStream>, n: usize) -> Result<CudaSlice<bf16>, String> {
    s.clone_htod(&vec![POISON_BF16; n]).map_err(e)
}

fn bits_of(s: &Arc<CudaStream>, v: &CudaSlice<bf16>) -> Result<Vec<u16>, String> {
    Ok(s.clone_dtoh(v)
        .map_err(e)?
        .iter()
        .map(|b| b.to_bits())
        .collect())
}

#[allow(clippy::too_many_arguments)]
fn run(
    s: &Arc<CudaStream>,
    kernels: &Kernels,
    shape: &Shape,
    ids: &CudaSlice<i32>,
    weights: &CudaSlice<f32>,
    row_of: &CudaSlice<i32>,
    x: &CudaSlice<bf16>,
    w: (&CudaSlice<bf16>, &CudaSlice<bf16>),
    grid_sync: Option<&mut CudaSlice<u32>>,
) -> Result<Outputs, String> {
    let &(d, i, ex, k, t, act, layout) = shape;
    let width = act.gate_up_width(i);
    let (kind, layout) = ActivationDesc::new(act, layout, i).kernel_kind();
    let mut h = poisoned(s, t * k * i)?;
    let mut y = poisoned(s, t * d)?;
    let mut h_pre_rows = poisoned(s, t * k * width)?;
    let mut y_e_rows = poisoned(s, t * k * d)?;
    let mut errors = s.alloc_zeros::<u32>(1).map_err(e)?;
    kernels
        .launch(
            s,
            mk::DecodeForward {
                tokens: t,
                top_k: k,
                hidden: d,
                intermediate: i,
                experts: ex,
                kind,
                layout,
                topk_ids: ids,
                topk_weights: weights,
                x,
                w_gate_up: w.0,
                w_down: w.1,
                h: &mut h,
                y: &mut y,
                row_of: Some(row_of),
                h_pre_rows: Some(&mut h_pre_rows),
                h_rows: None,
                y_e_rows: Some(&mut y_e_rows),
                errors: Some(&mut errors),
                grid_sync: grid_sync.map(|g| g as &mut dyn cudarc::driver::DevicePtrMut<u32>),
            },
        )
        .map_err(e)?;
    let raised = s.clone_dtoh(&errors).map_err(e)?[0];
    if raised != 0 {
        return Err(format!("{shape:?}: error word {raised:#x}"));
    }
    Ok(Outputs {
        y: bits_of(s, &y)?,
        h: bits_of(s, &h)?,
        h_pre_rows: bits_of(s, &h_pre_rows)?,
        y_e_rows: bits_of(s, &y_e_rows)?,
    })
}

fn same(what: &str, a: &[u16], b: &[u16]) -> Result<(), String> {
    match a.iter().zip(b).position(|(x, y)| x != y) {
        Some(j) => Err(format!(
            "{what}: element {j} differs ({:#06x} vs {:#06x})",
            a[j], b[j]
        )),
        None if a.iter().any(|&v| v == POISON_BF16.to_bits()) => {
            Err(format!("{what}: an output was never written"))
        }
        None => Ok(()),
    }
}

/// Every shape: fused (three calls in a row on one barrier) = two kernels, bit for bit.
pub fn fused_equals_two_kernels(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let s = ctx.new_stream().map_err(e)?;
    let kernels = Kernels::new(ctx).map_err(e)?;
    let mut rng = Rng::new(Rng::fresh_seed());
    let mut grid_sync = s.alloc_zeros::<u32>(2).map_err(e)?;
    let mut calls = 0u32;
    for shape in SHAPES {
        let &(d, i, ex, k, t, act, _) = shape;
        let width = act.gate_up_width(i);
        let ids: Vec<i32> = (0..t).flat_map(|_| rng.distinct(ex, k)).collect();
        let weights: Vec<f32> = (0..t * k).map(|_| 0.5 + 0.5 * rng.uniform()).collect();
        // Expert-major rows: any permutation of the slots serves the comparison.
        let mut rows: Vec<i32> = (0..(t * k) as i32).collect();
        for j in (1..rows.len()).rev() {
            rows.swap(j, rng.below(j + 1));
        }
        let scale = |v: Vec<bf16>, f: f32| {
            v.into_iter()
                .map(|b| bf16::from_f32(b.to_f32() * f))
                .collect::<Vec<_>>()
        };
        let x = s.clone_htod(&rng.bf16_vec(t * d)).map_err(e)?;
        let wg = s
            .clone_htod(&scale(
                rng.bf16_vec(ex * width * d),
                2.0 / (d as f32).sqrt(),
            ))
            .map_err(e)?;
        let wd = s
            .clone_htod(&scale(rng.bf16_vec(ex * d * i), 2.0 / (i as f32).sqrt()))
            .map_err(e)?;
        let ids_d = s.clone_htod(&ids).map_err(e)?;
        let w_d = s.clone_htod(&weights).map_err(e)?;
        let rows_d = s.clone_htod(&rows).map_err(e)?;
        let split = run(
            &s,
            &kernels,
            shape,
            &ids_d,
            &w_d,
            &rows_d,
            &x,
            (&wg, &wd),
            None,
        )?;
        for call in 0..3 {
            let fused = run(
                &s,
                &kernels,
                shape,
                &ids_d,
                &w_d,
                &rows_d,
                &x,
                (&wg, &wd),
                Some(&mut grid_sync),
            )?;
            calls += 1;
            let what = |o: &str| format!("{shape:?} call {call}: {o}");
            same(&what("y"), &fused.y, &split.y)?;
            same(&what("h"), &fused.h, &split.h)?;
            same(&what("h_pre_rows"), &fused.h_pre_rows, &split.h_pre_rows)?;
            same(&what("y_e_rows"), &fused.y_e_rows, &split.y_e_rows)?;
        }
        let words = s.clone_dtoh(&grid_sync).map_err(e)?;
        if words != [0, calls] {
            return Err(format!(
                "{shape:?}: barrier words {words:?} after {calls} calls, want [0, {calls}]"
            ));
        }
        println!("{shape:?}: fused = two kernels (3 calls), barrier words {words:?}");
    }
    Ok(())
}
