//! GPU tests of the fused stages against the CPU reference: [`gpu::gate_up_fused`] (the
//! token rows of x gathered by the GEMM's producer, the activation in its epilogue) for
//! every activation in both gate/up layouts, ragged and empty experts, sizes that are not
//! multiples of the tiles (hidden 200, I 72 and 136), one token, with and without `h_pre`,
//! gathering in the kernel or reading rows already gathered (`source_of: None`);
//! poisoned outputs (rows past the last routed row must keep their poison), and a bad
//! `source_of` entry flagged, not followed. Without a GPU every test prints SKIPPED; on a
//! GPU that is not sm_90a they check that the call is refused with an arch error.

#![forbid(unsafe_code)]

use cudarc::driver::{CudaContext, CudaStream};
use half::bf16;
use moefuse::gpu::{self, ActivationDesc, DeviceErrors, GateUpInputs, GateUpRows};
use moefuse::reference::activation;
use moefuse::{Activation, GateUpLayout, MoeError};
use moefuse_testkit::{check_close, to_f32, GpuSuite, Rng, BF16_REL_ERR, POISON_BF16};
use rayon::prelude::*;
use std::sync::Arc;

fn err<E: std::fmt::Display>(what: &str) -> impl Fn(E) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// One problem: tokens, top_k, experts, hidden, I, and experts that receive no token.
#[derive(Debug, Clone, Copy)]
struct Case {
    tokens: usize,
    top_k: usize,
    experts: usize,
    hidden: usize,
    inter: usize,
    /// Every `empty_every`-th expert gets no token (0: none empty).
    empty_every: usize,
}

/// Expert-major routing built on the host: `offsets`, `source_of` (t*k + j per row), and
/// `slot_token[r]` for the reference.
struct HostRouting {
    offsets: Vec<i32>,
    source_of: Vec<i32>,
    token_of_row: Vec<usize>,
    expert_of_row: Vec<usize>,
}

fn route(rng: &mut Rng, c: &Case) -> HostRouting {
    let allowed: Vec<i32> = (0..c.experts as i32)
        .filter(|e| c.empty_every == 0 || (*e as usize) % c.empty_every != 0)
        .collect();
    let mut per_expert: Vec<Vec<(usize, usize)>> = vec![Vec::new(); c.experts];
    for t in 0..c.tokens {
        for (j, pick) in rng.distinct(allowed.len(), c.top_k).into_iter().enumerate() {
            per_expert[allowed[pick as usize] as usize].push((t, j));
        }
    }
    let (mut offsets, mut source_of, mut token_of_row, mut expert_of_row) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (e, rows) in per_expert.iter().enumerate() {
        for &(t, j) in rows {
            source_of.push((t * c.top_k + j) as i32);
            token_of_row.push(t);
            expert_of_row.push(e);
        }
        offsets.push(source_of.len() as i32);
    }
    HostRouting {
        offsets,
        source_of,
        token_of_row,
        expert_of_row,
    }
}

/// Runs the fused gate_up on `case` and compares `h` (and `h_pre`) with the fp64 reference:
/// `h_pre = x[token] · W_eᵀ`, `h = act(h_pre)` on the unrounded pre-activation, as the
/// kernel's epilogue does. With `gathered`, the rows are gathered on the host into
/// `x_perm [T·k, hidden]` (poison past the routed rows) and the kernel reads them in order.
fn check(
    s: &Arc<CudaStream>,
    case: Case,
    (act, layout): (Activation, GateUpLayout),
    keep_h_pre: bool,
    gathered: bool,
    seed: u64,
) -> Result<(f64, f64), String> {
    let what =
        format!("{case:?} {act:?} {layout:?} h_pre={keep_h_pre} gathered={gathered} seed={seed}");
    let mut rng = Rng::new(seed);
    let desc = ActivationDesc::new(act, layout, case.inter);
    let (t, d, i) = (case.tokens, case.hidden, case.inter);
    let w_rows = desc.width();
    let x = rng.bf16_vec(t * d);
    let w: Vec<bf16> = rng
        .bf16_vec(case.experts * w_rows * d)
        .into_iter()
        .map(|v| bf16::from_f32(v.to_f32() * 0.25))
        .collect();
    let r = route(&mut rng, &case);
    let rows = r.source_of.len();
    let cap = t * case.top_k;

    // Reference, row-parallel.
    let (x32, w32) = (to_f32(&x), to_f32(&w));
    let want: Vec<(Vec<f32>, Vec<f32>)> = (0..rows)
        .into_par_iter()
        .map(|row| {
            let (tok, ex) = (r.token_of_row[row], r.expert_of_row[row]);
            let xr = &x32[tok * d..(tok + 1) * d];
            let pre: Vec<f32> = (0..w_rows)
                .map(|n| {
                    let wr = &w32[(ex * w_rows + n) * d..(ex * w_rows + n + 1) * d];
                    xr.iter()
                        .zip(wr)
                        .map(|(&a, &b)| f64::from(a) * f64::from(b))
                        .sum::<f64>() as f32
                })
                .collect();
            let mut h = vec![0f32; i];
            activation::forward_row(act, layout, &pre, &mut h);
            (pre, h)
        })
        .collect();
    let want_pre: Vec<f32> = want.iter().flat_map(|(p, _)| p.iter().copied()).collect();
    let want_h: Vec<f32> = want.iter().flat_map(|(_, h)| h.iter().copied()).collect();

    let x_perm: Vec<bf16> = (0..cap)
        .flat_map(|row| match r.token_of_row.get(row) {
            Some(&tok) => x[tok * d..(tok + 1) * d].to_vec(),
            None => vec![POISON_BF16; d],
        })
        .collect();
    let x_d = s
        .clone_htod(if gathered { &x_perm } else { &x })
        .map_err(|x| format!("{what}: {x}"))?;
    let w_d = s.clone_htod(&w).map_err(|x| format!("{what}: {x}"))?;
    let off_d = s
        .clone_htod(&r.offsets)
        .map_err(|x| format!("{what}: {x}"))?;
    // source_of sized for the capacity: the tail past the routed rows is poison the kernel
    // must not read (it reads only rows below offsets[E-1]).
    let mut src = r.source_of.clone();
    src.resize(cap, i32::MIN);
    let src_d = s.clone_htod(&src).map_err(|x| format!("{what}: {x}"))?;
    let mut h_d = s
        .clone_htod(&vec![POISON_BF16; cap * i])
        .map_err(|x| format!("{what}: {x}"))?;
    let mut pre_d = s
        .clone_htod(&vec![POISON_BF16; cap * w_rows])
        .map_err(|x| format!("{what}: {x}"))?;
    let mut errors = DeviceErrors::new(s).map_err(|x| format!("{what}: {x}"))?;
    let inputs = GateUpInputs {
        tokens: t,
        top_k: case.top_k,
        experts: case.experts,
        hidden: d,
        offsets: &off_d,
        rows: if gathered {
            GateUpRows::InOrder { x: &x_d }
        } else {
            GateUpRows::Gather {
                x: &x_d,
                source_of: &src_d,
            }
        },
        w: &w_d,
    };
    let h_pre = if keep_h_pre {
        Some(&mut pre_d as &mut dyn cudarc::driver::DevicePtrMut<bf16>)
    } else {
        None
    };
    gpu::gate_up_fused(&desc, s, inputs, &mut h_d, h_pre, &mut errors)
        .map_err(|x| format!("{what}: {x}"))?;
    errors.take().map_err(|x| format!("{what}: {x}"))?;
    let h = s.clone_dtoh(&h_d).map_err(|x| format!("{what}: {x}"))?;
    let pre = s.clone_dtoh(&pre_d).map_err(|x| format!("{what}: {x}"))?;
    let untouched = |buf: &[bf16], from: usize, which: &str| -> Result<(), String> {
        match buf[from..]
            .iter()
            .position(|v| v.to_bits() != POISON_BF16.to_bits())
        {
            Some(j) => Err(format!(
                "{what}: {which} element {} past the routed rows written",
                from + j
            )),
            None => Ok(()),
        }
    };
    untouched(&h, rows * i, "h")?;
    untouched(&pre, if keep_h_pre { rows * w_rows } else { 0 }, "h_pre")?;
    let eh = check_close(
        &to_f32(&h[..rows * i]),
        &want_h,
        BF16_REL_ERR,
        &format!("{what}: h"),
    )?;
    let ep = if keep_h_pre {
        check_close(
            &to_f32(&pre[..rows * w_rows]),
            &want_pre,
            BF16_REL_ERR,
            &format!("{what}: h_pre"),
        )?
    } else {
        0.0
    };
    Ok((eh, ep))
}

fn activations() -> Vec<Activation> {
    vec![
        Activation::SwiGlu,
        Activation::GeGlu,
        Activation::swiglu_oai(),
        Activation::BoundedSwiGlu { limit: 0.75 },
        Activation::Relu2,
    ]
}

const SMALL: Case = Case {
    tokens: 200,
    top_k: 4,
    experts: 16,
    hidden: 256,
    inter: 128,
    empty_every: 5,
};

/// Neither an sm_90a nor an sm_100a device: the call is refused with an arch error before
/// anything runs.
fn refused_elsewhere(s: &Arc<CudaStream>) -> Result<bool, String> {
    if gpu::gate_up_fused_supported(s).map_err(err("supported"))? {
        return Ok(false);
    }
    let r = check(
        s,
        SMALL,
        (Activation::SwiGlu, GateUpLayout::Split),
        false,
        false,
        1,
    );
    match r {
        Err(m) if m.contains("compute capability 9.0") || m.contains("rch") => {
            println!("not sm_90a: the fused gate_up is refused as it should be ({m})");
            Ok(true)
        }
        other => Err(format!(
            "expected an arch refusal off sm_90a, got {other:?}"
        )),
    }
}

fn every_activation_and_layout(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let s = ctx.default_stream();
    if refused_elsewhere(&s)? {
        return Ok(());
    }
    let mut seed = Rng::fresh_seed();
    for act in activations() {
        for layout in [GateUpLayout::Split, GateUpLayout::Interleaved] {
            for (keep, gathered) in [(false, false), (true, false), (false, true), (true, true)] {
                seed += 1;
                let (eh, ep) = check(&s, SMALL, (act, layout), keep, gathered, seed)?;
                println!(
                    "{act:?} {layout:?} h_pre={keep} gathered={gathered}: rel err h {eh:.2e}, h_pre {ep:.2e}"
                );
            }
        }
    }
    Ok(())
}

fn odd_sizes(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let s = ctx.default_stream();
    if refused_elsewhere(&s)? {
        return Ok(());
    }
    let cases = [
        // hidden not a multiple of the 64-wide k-block, I not a multiple of 128
        Case {
            tokens: 37,
            top_k: 2,
            experts: 8,
            hidden: 200,
            inter: 72,
            empty_every: 0,
        },
        Case {
            tokens: 1,
            top_k: 1,
            experts: 4,
            hidden: 64,
            inter: 64,
            empty_every: 0,
        },
        Case {
            tokens: 1,
            top_k: 8,
            experts: 64,
            hidden: 2048,
            inter: 136,
            empty_every: 3,
        },
        Case {
            tokens: 300,
            top_k: 8,
            experts: 32,
            hidden: 128,
            inter: 264,
            empty_every: 2,
        },
        Case {
            tokens: 129,
            top_k: 1,
            experts: 1,
            hidden: 72,
            inter: 8,
            empty_every: 0,
        },
        // >= 2048 rows per expert: the m-first tile order in bands of 16 m-blocks (17 here,
        // so one band boundary inside each expert); ragged groups.
        Case {
            tokens: 4100,
            top_k: 1,
            experts: 2,
            hidden: 64,
            inter: 64,
            empty_every: 0,
        },
    ];
    let mut seed = Rng::fresh_seed();
    for c in cases {
        for (act, layout) in [
            (Activation::SwiGlu, GateUpLayout::Split),
            (Activation::GeGlu, GateUpLayout::Interleaved),
            (Activation::Relu2, GateUpLayout::Split),
        ] {
            for gathered in [false, true] {
                seed += 1;
                let (eh, ep) = check(&s, c, (act, layout), true, gathered, seed)?;
                println!("{c:?} {act:?} {layout:?} gathered={gathered}: rel err h {eh:.2e}, h_pre {ep:.2e}");
            }
        }
    }
    Ok(())
}

/// A `source_of` entry outside `0..T*k` is flagged and token 0 is read instead; nothing
/// outside the buffers is touched (compute-sanitizer checks that part).
fn bad_source_flagged(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let s = ctx.default_stream();
    if refused_elsewhere(&s)? {
        return Ok(());
    }
    let (t, k, e, d, i) = (8usize, 2usize, 2usize, 64usize, 64usize);
    let mut rng = Rng::new(9);
    let x = s.clone_htod(&rng.bf16_vec(t * d)).map_err(err("x"))?;
    let w = s
        .clone_htod(&rng.bf16_vec(e * 2 * i * d))
        .map_err(err("w"))?;
    let offsets = s.clone_htod(&[8i32, 16]).map_err(err("offsets"))?;
    let mut src: Vec<i32> = (0..16).collect();
    src[3] = 1 << 30;
    src[11] = -5;
    let source_of = s.clone_htod(&src).map_err(err("source_of"))?;
    let mut h = s.alloc_zeros::<bf16>(t * k * i).map_err(err("h"))?;
    let mut errors = DeviceErrors::new(&s).map_err(err("errors"))?;
    let desc = ActivationDesc::new(Activation::SwiGlu, GateUpLayout::Split, i);
    let inputs = GateUpInputs {
        tokens: t,
        top_k: k,
        experts: e,
        hidden: d,
        offsets: &offsets,
        rows: GateUpRows::Gather {
            x: &x,
            source_of: &source_of,
        },
        w: &w,
    };
    gpu::gate_up_fused(&desc, &s, inputs, &mut h, None, &mut errors).map_err(err("launch"))?;
    match errors.take() {
        Err(MoeError::InvalidDeviceRouting {
            source_out_of_range: true,
            ..
        }) => Ok(()),
        other => Err(format!("bad source_of entries not flagged: {other:?}")),
    }
}

fn main() {
    GpuSuite::new()
        .test(
            "gate_up_fused_every_activation_and_layout",
            every_activation_and_layout,
        )
        .test("gate_up_fused_odd_sizes_and_empty_experts", odd_sizes)
        .test("gate_up_fused_flags_bad_source_of", bad_source_flagged)
        .run()
}
