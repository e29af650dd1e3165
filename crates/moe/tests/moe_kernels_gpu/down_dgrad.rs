//! The fused down dgrad (`moefuse_moe_down_dgrad_fused`: the dgrad GEMM gathering dy's
//! token rows, the routed activation backward in its epilogue) called directly and compared
//! with the CPU reference: `dh_u = bf16(dy[t] · D_e)` in f64, then `d_h_pre`, `h_scaled` and
//! `d_topk_weights` as the routed backward defines them. Ragged and empty experts, `I` and
//! `D` not multiples of the tile, several 256-column blocks, CTA pairs; outputs poisoned; a
//! bad slot and a stale stamp raise their bits.

use super::{activations, err, shuffle, POISON_F32};
use cudarc::driver::{CudaContext, CudaStream, DevicePtr};
use half::bf16;
use moefuse::reference::activation;
use moefuse::{Activation, GateUpLayout};
use moefuse_kernels::ffi::{MOEFUSE_MOE_ERROR_SOURCE, MOEFUSE_MOE_ERROR_STALE};
use moefuse_kernels::{self as mk, Kernels};
use moefuse_testkit::{check_close, to_f32, Rng, BF16_REL_ERR, POISON_BF16};
use rayon::prelude::*;
use std::sync::Arc;

/// One case: `t` tokens of `k` slots over experts `0..experts_used` of `e`, `D = d`, `I = i`.
#[derive(Clone, Copy, Debug)]
struct Case {
    t: usize,
    k: usize,
    e: usize,
    experts_used: usize,
    d: usize,
    i: usize,
    /// A row whose slot is out of range (its dy row reads as zeros, its slot is not written).
    bad_row: Option<usize>,
    /// The tokens stamp disagrees: d_topk_weights is not written.
    stale: bool,
}

const fn case(t: usize, k: usize, e: usize, d: usize, i: usize) -> Case {
    Case {
        t,
        k,
        e,
        experts_used: e,
        d,
        i,
        bad_row: None,
        stale: false,
    }
}

/// Routing: each token picks `k` distinct experts of the used ones; rows expert-major, the
/// tokens in order within an expert. Returns (offsets, source_of).
fn route(rng: &mut Rng, c: &Case) -> (Vec<i32>, Vec<i32>) {
    let mut per_expert: Vec<Vec<i32>> = vec![Vec::new(); c.e];
    for t in 0..c.t {
        let mut ids: Vec<usize> = (0..c.experts_used).collect();
        shuffle(rng, &mut ids);
        for (j, &x) in ids[..c.k].iter().enumerate() {
            per_expert[x].push((t * c.k + j) as i32);
        }
    }
    let mut offsets = Vec::with_capacity(c.e);
    let mut source_of = Vec::with_capacity(c.t * c.k);
    for rows in &per_expert {
        source_of.extend_from_slice(rows);
        offsets.push(source_of.len() as i32);
    }
    (offsets, source_of)
}

struct Want {
    d_h_pre: Vec<f32>,
    h_scaled: Vec<f32>,
    d_weights: Vec<f32>,
}

/// The reference over every row: `dh_u` rounded to bf16 as the GEMM's output is, `h` as
/// the forward stored it. A bad row's outputs are zeros (dy read as zeros, w = 0) and its
/// slot is left poisoned; with a stale stamp no slot is written.
#[allow(clippy::too_many_arguments)]
fn reference(
    c: &Case,
    act: Activation,
    layout: GateUpLayout,
    offsets: &[i32],
    source_of: &[i32],
    dy: &[f32],
    w: &[f32],
    h_pre: &[f32],
    weights: &[f32],
) -> Want {
    let (d, i, k, rows) = (c.d, c.i, c.k, c.t * c.k);
    let width = act.gate_up_width(i);
    let expert_of = |r: usize| offsets.iter().position(|&end| r < end as usize).unwrap();
    let per_row: Vec<(Vec<f32>, Vec<f32>, f64)> = (0..rows)
        .into_par_iter()
        .map(|r| {
            let s = source_of[r];
            let valid = s >= 0 && (s as usize) < rows;
            let (ex, t) = (expert_of(r), if valid { s as usize / k } else { 0 });
            let wt = if valid { weights[s as usize] } else { 0.0 };
            let mut dh_u = vec![0f32; i];
            if valid {
                for (j, o) in dh_u.iter_mut().enumerate() {
                    let acc: f64 = (0..d)
                        .map(|q| f64::from(dy[t * d + q]) * f64::from(w[(ex * d + q) * i + j]))
                        .sum();
                    *o = bf16::from_f64(acc).to_f32();
                }
            }
            let x = &h_pre[r * width..(r + 1) * width];
            let mut h = vec![0f32; i];
            activation::forward_row(act, layout, x, &mut h);
            let (mut dot, mut hs, mut dh) = (0f64, vec![0f32; i], vec![0f64; i]);
            for j in 0..i {
                let hb = bf16::from_f32(h[j]).to_f32();
                dot += f64::from(dh_u[j]) * f64::from(hb);
                hs[j] = wt * hb;
                dh[j] = f64::from(wt) * f64::from(dh_u[j]);
            }
            let mut dx = vec![0f64; width];
            activation::backward_row(act, layout, x, &dh, &mut dx);
            (dx.iter().map(|&v| v as f32).collect(), hs, dot)
        })
        .collect();
    let mut want = Want {
        d_h_pre: Vec::with_capacity(rows * width),
        h_scaled: Vec::with_capacity(rows * i),
        d_weights: vec![POISON_F32; rows],
    };
    for (r, (dhp, hs, dot)) in per_row.into_iter().enumerate() {
        want.d_h_pre.extend(dhp);
        want.h_scaled.extend(hs);
        let s = source_of[r];
        if !c.stale && s >= 0 && (s as usize) < rows {
            want.d_weights[s as usize] = dot as f32;
        }
    }
    want
}

fn check_case(
    stream: &Arc<CudaStream>,
    kernels: &Kernels,
    act: Activation,
    layout: GateUpLayout,
    c: &Case,
    seed: u64,
) -> Result<(f64, f64, f64), String> {
    let what = format!("down dgrad fused {act:?} {layout:?} {c:?} seed={seed}");
    let e = err(&what);
    let mut rng = Rng::new(seed);
    let (d, i, rows) = (c.d, c.i, c.t * c.k);
    let width = act.gate_up_width(i);
    let scale = match act {
        Activation::SwiGluOai { limit, .. } | Activation::BoundedSwiGlu { limit } => 1.5 * limit,
        _ => 3.0,
    };
    let rand_bf16 = |rng: &mut Rng, n: usize, s: f32| -> Vec<bf16> {
        (0..n).map(|_| bf16::from_f32(s * rng.uniform())).collect()
    };
    let dy = rand_bf16(&mut rng, c.t * d, 1.0);
    let w = rand_bf16(&mut rng, c.e * d * i, 1.0 / (d as f32).sqrt());
    let h_pre = rand_bf16(&mut rng, rows * width, scale);
    let weights: Vec<f32> = (0..rows).map(|_| 0.3 + 0.5 * rng.uniform()).collect();
    let (offsets, mut source_of) = route(&mut rng, c);
    if let Some(r) = c.bad_row {
        source_of[r] = (rows + 5) as i32;
    }
    let want = reference(
        c,
        act,
        layout,
        &offsets,
        &source_of,
        &to_f32(&dy),
        &to_f32(&w),
        &to_f32(&h_pre),
        &weights,
    );

    let up = |v: &[bf16]| stream.clone_htod(v).map_err(&e);
    let (dy_d, w_d, h_pre_d) = (up(&dy)?, up(&w)?, up(&h_pre)?);
    let offsets_d = stream.clone_htod(&offsets).map_err(&e)?;
    let src_d = stream.clone_htod(&source_of).map_err(&e)?;
    let weights_d = stream.clone_htod(&weights).map_err(&e)?;
    let mut dhp_d = up(&vec![POISON_BF16; rows * width])?;
    let mut hs_d = up(&vec![POISON_BF16; rows * i])?;
    let blocks = i.div_ceil(mk::DOWN_DGRAD_COLUMN_BLOCK);
    let mut partials_d = stream
        .clone_htod(&vec![POISON_F32; rows * blocks])
        .map_err(&e)?;
    let mut dw_d = stream.clone_htod(&vec![POISON_F32; rows]).map_err(&e)?;
    let mut errors_d = stream.clone_htod(&[0u32]).map_err(&e)?;
    let stamp = c.t as u32 + u32::from(c.stale);
    let stamp_d = stream.clone_htod(&[stamp]).map_err(&e)?;
    let (kind, kl) = moefuse::gpu::ActivationDesc::new(act, layout, i).kernel_kind();
    kernels
        .launch(
            stream,
            mk::DownDgradFused {
                tokens: c.t,
                top_k: c.k,
                hidden: d,
                intermediate: i,
                experts: c.e,
                kind,
                layout: kl,
                tile_order: 0,
                offsets: &offsets_d,
                source_of: &src_d,
                weights: &weights_d,
                dy: &dy_d,
                w: &w_d,
                h_pre: &h_pre_d,
                d_h_pre: &mut dhp_d,
                h_scaled: &mut hs_d,
                partials: &mut partials_d,
                d_weights: &mut dw_d,
                errors: Some(&mut errors_d),
                expect_tokens: Some(&stamp_d as &dyn DevicePtr<u32>),
            },
        )
        .map_err(|x| format!("{what}: {x}"))?;
    let dhp = to_f32(&stream.clone_dtoh(&dhp_d).map_err(&e)?);
    let hs = to_f32(&stream.clone_dtoh(&hs_d).map_err(&e)?);
    let dw = stream.clone_dtoh(&dw_d).map_err(&e)?;
    let errors = stream.clone_dtoh(&errors_d).map_err(&e)?[0];

    let want_bits = if c.bad_row.is_some() {
        MOEFUSE_MOE_ERROR_SOURCE
    } else {
        0
    } | if c.stale { MOEFUSE_MOE_ERROR_STALE } else { 0 };
    if errors != want_bits {
        return Err(format!(
            "{what}: error word {errors:#x}, expected {want_bits:#x}"
        ));
    }
    // Slots the reference leaves unwritten keep their poison; the rest are compared.
    for (s, (g, w)) in dw.iter().zip(&want.d_weights).enumerate() {
        if w.to_bits() == POISON_F32.to_bits() && g.to_bits() != POISON_F32.to_bits() {
            return Err(format!(
                "{what}: d_weights[{s}] must not be written, holds {g}"
            ));
        }
    }
    let (g, w_): (Vec<f32>, Vec<f32>) = dw
        .iter()
        .zip(&want.d_weights)
        .filter(|(_, w)| w.to_bits() != POISON_F32.to_bits())
        .map(|(g, w)| (*g, *w))
        .unzip();
    let e_dw = if g.is_empty() {
        0.0
    } else {
        check_close(&g, &w_, BF16_REL_ERR, &format!("{what}: d_weights"))?
    };
    let e_dhp = check_close(
        &dhp,
        &want.d_h_pre,
        BF16_REL_ERR,
        &format!("{what}: d_h_pre"),
    )?;
    let e_hs = check_close(
        &hs,
        &want.h_scaled,
        BF16_REL_ERR,
        &format!("{what}: h_scaled"),
    )?;
    Ok((e_dhp, e_hs, e_dw))
}

/// Every activation and layout on a ragged problem, then the shapes: several column blocks,
/// CTA pairs, tails of D and I, empty experts, one token, a bad slot, a stale stamp.
pub fn fused_down_dgrad(ctx: &Arc<CudaContext>) -> Result<(), String> {
    let stream = ctx.default_stream();
    let kernels = Kernels::new(ctx).map_err(err("kernels"))?;
    let seed = Rng::fresh_seed();
    if !moefuse::gpu::gate_up_fused_supported(&stream).map_err(err("supported"))? {
        // Off sm_90a and sm_100a the launcher refuses with an arch error, before any launch.
        let refused = check_case(
            &stream,
            &kernels,
            Activation::SwiGlu,
            GateUpLayout::Split,
            &case(4, 1, 2, 64, 64),
            seed,
        );
        return match refused {
            Err(m) if m.contains("compute capability 9.0") || m.contains("rch") => {
                println!("SKIP fused down dgrad: not sm_90a, refused as it should be ({m})");
                Ok(())
            }
            other => Err(format!(
                "expected an arch refusal off sm_90a, got {other:?}"
            )),
        };
    }
    let mut worst = [0f64; 3];
    let mut note = |r: (f64, f64, f64)| {
        worst = [worst[0].max(r.0), worst[1].max(r.1), worst[2].max(r.2)];
    };
    let mut n = 0u64;
    for act in activations() {
        for layout in [GateUpLayout::Split, GateUpLayout::Interleaved] {
            if act == Activation::Relu2 && layout == GateUpLayout::Interleaved {
                continue;
            }
            n += 1;
            note(check_case(
                &stream,
                &kernels,
                act,
                layout,
                &case(150, 3, 6, 72, 136),
                seed + n,
            )?);
        }
    }
    let shapes = [
        // Two column blocks, the second partial; a ragged hidden.
        case(300, 2, 8, 200, 328),
        // CTA pairs (rows >= 256 per expert on average) and three blocks.
        Case {
            experts_used: 3,
            ..case(700, 2, 4, 128, 768)
        },
        // The smallest I, an odd D.
        case(33, 4, 5, 40, 8),
        // One token, top-1.
        case(1, 1, 4, 64, 64),
        Case {
            bad_row: Some(7),
            ..case(40, 2, 4, 64, 264)
        },
        Case {
            stale: true,
            ..case(40, 2, 4, 64, 64)
        },
    ];
    for c in &shapes {
        n += 1;
        note(check_case(
            &stream,
            &kernels,
            Activation::SwiGlu,
            GateUpLayout::Split,
            c,
            seed + n,
        )?);
    }
    eprintln!(
        "fused down dgrad: {n} cases, worst rel err d_h_pre {:.2e}, h_scaled {:.2e}, d_weights {:.2e} (seed {seed})",
        worst[0], worst[1], worst[2]
    );
    Ok(())
}
